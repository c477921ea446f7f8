"""Small helpers shared by the public dataclasses."""

import dataclasses
import functools

from spanserve.errors import InvalidRequestError


def strict_kwargs(cls):
    """Make a dataclass reject unknown keywords with an error that lists the valid ones.

    A plain dataclass raises `TypeError: unexpected keyword argument`, which reads like a
    bug in our code; users mistyping `max_token=` deserve a message naming the field.
    """
    init = cls.__init__
    valid = [f.name for f in dataclasses.fields(cls) if f.init]

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        unknown = sorted(set(kwargs) - set(valid))
        if unknown:
            raise InvalidRequestError(
                f"unknown {cls.__name__} keyword(s): {', '.join(unknown)}; "
                f"valid keywords are: {', '.join(valid)}"
            )
        init(self, *args, **kwargs)

    cls.__init__ = checked_init
    return cls
