"""``kvferry plan``: every rank's keys, ports and head slices for one stage pair."""
