"""Registered role entry points: the only programs a guard may start (`python -m <module>`).

The guard never runs an arbitrary command: a spawn request names a role, the role maps to a Python module
of this project, and the child is `<guard's interpreter> -m <module>`. An unknown role is refused with 403
before anything runs. Extend `ROLE_MODULES` when a role's entry point lands; a site may add roles at guard
start (`mopd-guard --extra-role NAME=MODULE`), never through the HTTP API.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

#: role → module run with `python -m` (one entry point per role, in `mopd_hpc/roles/`); a role whose module
#: this interpreter cannot find is refused with a message naming the module.
ROLE_MODULES: Mapping[str, str] = MappingProxyType(
    {
        "actor": "mopd_hpc.roles.actor",
        # the run's teacher: settings from run_dir/config.yaml, then engines.teacher.process.serve
        "teacher": "mopd_hpc.roles.teacher",
        "rollout": "mopd_hpc.roles.rollout",
        "probe": "mopd_hpc.roles.probe",
    }
)

_ROLE_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class UnregisteredRoleError(ValueError):
    """A spawn named a role that is not registered (HTTP 403)."""


class RoleModuleMissingError(ValueError):
    """A registered role's module cannot be found by the guard's interpreter (HTTP 409)."""


@dataclass(frozen=True, slots=True)
class RoleRegistry:
    """An immutable role → module table. Build with `RoleRegistry.create(extra=...)`."""

    modules: Mapping[str, str] = field(default_factory=lambda: ROLE_MODULES)

    @classmethod
    def create(cls, extra: Mapping[str, str] | None = None) -> RoleRegistry:
        """The default table plus `extra` roles. Raises ValueError naming a malformed role or module."""
        table = dict(ROLE_MODULES)
        for role, module in (extra or {}).items():
            if not _ROLE_RE.match(role):
                raise ValueError(f"role {role!r} is invalid: expected lowercase [a-z][a-z0-9_-]*")
            if not _MODULE_RE.match(module):
                raise ValueError(f"module {module!r} for role {role!r} is not a dotted Python module name")
            table[role] = module
        return cls(MappingProxyType(table))

    def module_for(self, role: str) -> str:
        """The module of `role`.

        Raises:
            UnregisteredRoleError: `role` is not registered. RoleModuleMissingError: its module is absent.
        """
        module = self.modules.get(role) if isinstance(role, str) else None
        if module is None:
            raise UnregisteredRoleError(
                f"role {role!r} is not a registered entry point; registered roles: {sorted(self.modules)}"
            )
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise RoleModuleMissingError(
                f"role {role!r} is registered as module {module!r}, which this interpreter cannot import"
            )
        return module


def parse_extra_roles(items: list[str]) -> dict[str, str]:
    """`["name=pkg.module", ...]` → `{"name": "pkg.module"}`. Raises ValueError naming a bad item."""
    out = {}
    for item in items:
        role, sep, module = item.partition("=")
        if not sep or not role or not module:
            raise ValueError(f"--extra-role {item!r} is invalid: expected NAME=MODULE (e.g. probe2=pkg.mod)")
        out[role] = module
    return out
