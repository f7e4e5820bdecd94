"""A TensorConsumer's settings, resolved once (the argument, else the environment, else the
default; see tensorsocket.config), and what share() knows of the loader of its caller."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .. import config
from ..control.auth import ClientSecret
from ..control.endpoints import Endpoint, resolve
from ..data.delivery import Delivery
from ..data.rebatch import Rebatcher
from ..ring import MAX_CONSUMERS


@dataclass
class SharedLoader:
    """What share() passes to the consumer it returns (TensorConsumer(shared=)).

    loader: the caller's own loader (its attributes, its sampling: LoaderSurface).
    drop_last: that loader's drop_last (the consumer's, when it takes the producer's
      batches as they are).
    started_producer / producer_log: whether this share() call started the producer,
      and the producer's log file.
    before_ready: called once the consumer has its place in the ring, before it says
      ready (a rank of a group: the ranks wait for each other there, and share() lets go
      of its election lock first, which the other ranks need to attach); None: ready at
      once."""

    loader: Any
    drop_last: bool
    started_producer: bool
    producer_log: Any
    before_ready: Callable[[], None] | None = None


@dataclass(kw_only=True)
class ConsumerOptions:
    """A consumer's settings as resolved, checked, and the objects made of them: its
    re-batcher (batch_size=) and its Delivery (device=, copy=, pin_memory=,
    peer_access=). The fields keep the meanings of the TensorConsumer arguments."""

    endpoint: Endpoint
    batch_size: int | None  # None: the producer's batches as they are
    drop_last: bool
    answer_wait: float | None  # timeout=
    batch_wait: float | None  # batch_timeout=
    copy: bool
    with_index: bool
    pin_memory: bool
    peer_access: bool
    align_epochs: bool
    rank: int
    world_size: int
    group: str | None
    rebatcher: Rebatcher | None
    delivery: Delivery
    secret: ClientSecret
    watch: bool  # the name's lock file tells of a producer that dies before answering
    origins: str | None  # settings taken from the environment, for the log

    @classmethod
    def resolve(cls, *, port: int | str | None, address: str | None, name: str | None,
                timeout: Any, batch_timeout: Any, device: Any, batch_size: int | None,
                drop_last: bool, copy: bool, with_index: bool, pin_memory: bool,
                peer_access: bool, align_epochs: bool, rank: int | None,
                world_size: int | None, group: str | None,
                auth_token: str | None) -> "ConsumerOptions":
        """The TensorConsumer arguments resolved and checked, in the order the errors
        come (ValueError / TypeError naming the argument)."""
        given = config.Resolver()
        answer_wait: float | None = given.get("timeout", timeout)
        batch_wait: float | None = given.get("batch_timeout", batch_timeout)
        if isinstance(device, str) and device == "auto":
            device = None  # explicitly the default: the environment does not apply
        else:
            device = given.get("consumer_device", device)
        name = given.get("name", name)
        if port is None:
            address = given.get("address", address)
        given.get("runtime_dir")
        rebatcher = Rebatcher(batch_size, drop_last) if batch_size is not None else None
        delivery = Delivery(device, bool(copy), bool(pin_memory), bool(peer_access))
        rank, world_size = check_group(rank, world_size)
        if group is not None and (not isinstance(group, str) or len(group) > 200):
            raise TypeError(f"group must be a str of at most 200 characters, got {group!r}")
        endpoint = resolve(name, port, address)
        # The name's lock file tells of a producer that died before answering; an address
        # given explicitly may belong to a producer of another name.
        return cls(endpoint=endpoint, batch_size=batch_size, drop_last=bool(drop_last),
                   answer_wait=answer_wait, batch_wait=batch_wait, copy=bool(copy),
                   with_index=bool(with_index), pin_memory=bool(pin_memory),
                   peer_access=bool(peer_access), align_epochs=bool(align_epochs),
                   rank=rank, world_size=world_size, group=group, rebatcher=rebatcher,
                   delivery=delivery, secret=ClientSecret(endpoint, auth_token),
                   watch=port is not None or address is None,
                   origins=given.describe() if given.origins else None)


def check_group(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size) of a consumer group, checked; (0, 1) for a lone consumer."""
    if rank is None and world_size is None:
        return 0, 1
    if rank is None or world_size is None:
        raise ValueError("give rank= and world_size= together (a consumer group: the ranks "
                         "of one data-parallel job split the stream), or neither")
    for what, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{what} must be an int, got {value!r}")
    if not 1 <= world_size <= MAX_CONSUMERS or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} and world_size={world_size}: need 0 <= rank < "
                         f"world_size <= {MAX_CONSUMERS}")
    return rank, world_size
