"""Who is asking: API keys, the tenant each belongs to, and the cache namespace of a tenant.

Every request of a tenant carries a cache salt made from its tenant name (and, within it, the
client's own cache_salt): prefix blocks, span blocks and everything hashed from them are then
never shared across tenants, so cached_tokens, timings and span hits say nothing about another
tenant's prompts."""

import base64
import hmac
import json
from dataclasses import dataclass
from pathlib import Path

from spanserve.errors import InvalidRequestError

DEFAULT_TENANT = "default"  # the tenant of --api-key


@dataclass(frozen=True)
class Tenants:
    keys: tuple[tuple[bytes, str], ...]  # (b"Bearer KEY", tenant)

    @classmethod
    def load(cls, api_key: str | None = None, keys_file: str | None = None) -> "Tenants | None":
        """--api-key and --api-keys FILE (one `KEY TENANT` per line; blank lines and # comments
        skipped); None if neither is given (an open server: one shared tenant)."""
        pairs = [(api_key, DEFAULT_TENANT)] if api_key else []
        if keys_file:
            pairs += _read_keys(Path(keys_file))
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise InvalidRequestError(f"API key listed twice ({key[:4]}...): each key names one tenant")
            seen.add(key)
        return cls(tuple((f"Bearer {k}".encode(), t) for k, t in pairs)) if pairs else None

    def tenant_of(self, authorization: bytes, basic: bool = False) -> str | None:
        """The tenant of an Authorization header, or None. Every key is compared, in constant
        time, so the time taken says nothing about which key came close. With `basic`, HTTP Basic
        credentials whose password is a key count too (what a browser sends after its prompt)."""
        if basic and authorization[:6].lower() == b"basic ":
            try:
                _, _, password = base64.b64decode(authorization[6:].strip(), validate=True).partition(b":")
            except ValueError:
                return None
            authorization = b"Bearer " + password
        found = None
        for expected, tenant in self.keys:
            if hmac.compare_digest(authorization, expected):
                found = tenant
        return found


def _read_keys(path: Path) -> list[tuple[str, str]]:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise InvalidRequestError(f"cannot read --api-keys file {path}: {exc}") from exc
    pairs = []
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2:
            raise InvalidRequestError(f"{path}:{number}: expected `KEY TENANT`, got {len(fields)} fields")
        pairs.append((fields[0], fields[1]))
    return pairs


def cache_salt(tenant: str | None, salt: str | None) -> str | None:
    """The engine's cache salt of a request: the tenant's namespace and, within it, the client's."""
    if tenant is None:
        return salt
    return json.dumps([tenant, salt])


def tenant_of(http) -> str | None:
    """The tenant of a request's API key (AuthMiddleware sets it), None on a server without keys."""
    return getattr(http.state, "tenant", None)
