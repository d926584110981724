"""``kvferry inspect FILE``: decode a payload file and print its header and tensor table."""
