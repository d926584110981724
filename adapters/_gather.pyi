"""Types of the optional native gather (adapters/_gather.c); see its docstrings."""

def gather(
    dst: int,
    src: int,
    index: int,
    n: int,
    nblocks: int,
    block_stride: int,
    d0: int,
    s0: int,
    d1: int,
    s1: int,
    d2: int,
    s2: int,
    piece: int,
    stream: bool,
    /,
) -> None: ...
def gather_split(
    dsts: tuple[int, ...],
    split_stride: int,
    src: int,
    index: int,
    n: int,
    nblocks: int,
    block_stride: int,
    d0: int,
    s0: int,
    d1: int,
    s1: int,
    d2: int,
    s2: int,
    piece: int,
    stream: bool,
    /,
) -> None: ...
def isa() -> str: ...
def set_isa(name: str | None, /) -> bool: ...
