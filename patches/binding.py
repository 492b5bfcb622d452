"""Bind a call to an upstream helper's signature: ``helper(*args, **kwargs)`` -> its values by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CallSignature"]


@dataclass(frozen=True)
class CallSignature:
    """An upstream helper's positional-or-keyword parameters, their defaults, and whether it takes
    ``**kwargs`` (a keyword torchembed's replacement cannot give a meaning to is then refused)."""

    name: str  # how errors name the replacement
    params: tuple[str, ...]
    defaults: dict[str, Any]
    keywords: bool = False

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """Upstream's parameter names -> the values of this call (defaults filled in); the TypeError
        where upstream would raise one."""
        params = self.params
        if len(args) > len(params):
            raise TypeError(f"{self.name}() takes {len(params)} positional arguments but {len(args)} were given")
        values = dict(zip(params, args))
        for name, value in kwargs.items():
            if name not in params:
                if self.keywords:  # upstream would take it into **kwargs, with a meaning not probed
                    raise TypeError(f"{self.name}(): upstream's helper takes **kwargs, and torchembed's rotation "
                                    f"does not know what {name!r} means to it; unpatch to call it with {name!r}")
                raise TypeError(f"{self.name}() got an unexpected keyword argument {name!r}")
            if name in values:
                raise TypeError(f"{self.name}() got multiple values for argument {name!r}")
            values[name] = value
        for name in params:
            if name not in values:
                if name not in self.defaults:
                    raise TypeError(f"{self.name}() missing required argument {name!r}")
                values[name] = self.defaults[name]
        return values
