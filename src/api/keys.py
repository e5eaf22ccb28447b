"""API keys: where they come from, and a constant-time check that never keeps them in the clear.

    keys = load_api_keys(flag=None, file="/etc/slotserve/keys", environ=os.environ)
    keys.match("sk-...")      # index of the key it equals, or None
    keys.describe()           # "2 API keys (2 from --api-key-file /etc/slotserve/keys)"

Sources, all accepted at once (a request may send a key from any of them):

- `--api-key-file PATH`: one key per line; blank lines and lines whose first non-blank
  character is `#` are ignored (a `#` after a key is not a comment: it makes the line invalid).
- `$SLOTSERVE_API_KEY`: one or more keys separated by commas and/or newlines.
- `--api-key KEY`: one key; other local users can read it with `ps`.

A key is printable ASCII without spaces (what an HTTP header carries unchanged). A source that
is given but holds no key (empty file or variable, unreadable file) is an error, never a
server without auth. Only SHA-256 digests are kept, so no repr, log line or traceback local
can show a key; comparing fixed-length digests with `hmac.compare_digest`, against every key
without stopping at the first match, takes the same time whatever the caller sent.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

ENV = "SLOTSERVE_API_KEY"
FLAG = "--api-key"
FILE_FLAG = "--api-key-file"

_VALID = re.compile(r"[\x21-\x7e]+")
_ENV_SEPARATORS = re.compile(r"[,\r\n]")
_INVALID = ("is not a valid API key (printable ASCII without spaces; a '#' comment must start "
            "its own line)")


class APIKeyError(ValueError):
    """A key source that cannot be used; the message names the source, never a key."""


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "replace")).digest()


class APIKeys:
    """The accepted keys (as digests) and where they came from; empty means no auth."""

    def __init__(self, keys: Iterable[str] = (),
                 sources: Iterable[tuple[str, int]] = ()) -> None:
        self._digests = tuple(dict.fromkeys(_digest(k) for k in keys))
        self.sources = tuple(sources)  # (source name, number of keys it gave)
        self.warnings: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self._digests)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __repr__(self) -> str:
        return f"APIKeys({len(self)} keys)"

    def match(self, token: str) -> int | None:
        """Index of the key `token` equals, else None; compares with every key, in constant time."""
        given = _digest(token)
        found = None
        for i, digest in enumerate(self._digests):
            equal = hmac.compare_digest(given, digest)
            found = i if equal and found is None else found
        return found

    def describe(self) -> str:
        """'2 API keys (1 from --api-key-file k.txt, 1 from $SLOTSERVE_API_KEY)': never a key."""
        if not self:
            return "no API key: every client is served"
        n = len(self)
        where = ", ".join(f"{count} from {name}" for name, count in self.sources)
        return f"{n} API key{'s' if n != 1 else ''}" + (f" ({where})" if where else "")


def _check(keys: list[str], source: str, unit: str) -> list[str]:
    for n, key in enumerate(keys, 1):
        if not _VALID.fullmatch(key):
            raise APIKeyError(f"{source}: {unit} {n} {_INVALID}")
    return keys


def keys_from_file(path: str | os.PathLike[str]) -> tuple[list[str], list[str]]:
    """The keys in a key file and any warnings about it (a file others can read)."""
    source = f"{FILE_FLAG} {path}"
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise APIKeyError(f"{source}: cannot read it ({exc.strerror or exc})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise APIKeyError(f"{source}: not UTF-8 text") from None
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if not _VALID.fullmatch(line):
            raise APIKeyError(f"{source}: line {n} {_INVALID}")
        keys.append(line)
    if not keys:
        raise APIKeyError(f"{source}: holds no key (one key per line; blank lines and lines "
                          f"starting with '#' are ignored)")
    warnings = []
    if os.name == "posix":
        mode = os.stat(path).st_mode
        if mode & (stat.S_IRGRP | stat.S_IROTH):
            warnings.append(f"{source} is readable by other users (mode "
                            f"{stat.S_IMODE(mode):o}); chmod 600 it")
    return keys, warnings


def keys_from_env(value: str) -> list[str]:
    keys = [k.strip() for k in _ENV_SEPARATORS.split(value) if k.strip()]
    if not keys:
        raise APIKeyError(f"${ENV} is set but holds no key (separate keys with commas or "
                          f"newlines; unset it to serve without a key)")
    return _check(keys, f"${ENV}", "key")


def load_api_keys(flag: str | None = None, file: str | os.PathLike[str] | None = None,
                  environ: Mapping[str, str] | None = None) -> APIKeys:
    """Every key from `--api-key`, `--api-key-file` and `$SLOTSERVE_API_KEY` (all accepted).

    None of them given: no keys (no auth). Raises APIKeyError for a source that is given but
    unusable (empty, unreadable, or holding an invalid key).
    """
    keys: list[str] = []
    sources: list[tuple[str, int]] = []
    warnings: list[str] = []
    if flag is not None:
        if not flag.strip():
            raise APIKeyError(f"{FLAG} is empty (leave it out to serve without a key)")
        keys += _check([flag.strip()], FLAG, "key")
        sources.append((f"{FLAG} (visible to other local users in ps)", 1))
    if file is not None:
        from_file, warnings = keys_from_file(file)
        keys += from_file
        sources.append((f"{FILE_FLAG} {file}", len(from_file)))
    value = (os.environ if environ is None else environ).get(ENV)
    if value is not None:
        from_env = keys_from_env(value)
        keys += from_env
        sources.append((f"${ENV}", len(from_env)))
    result = APIKeys(keys, sources)
    result.warnings = tuple(warnings)
    return result


def as_api_keys(api_key: str | Iterable[str] | APIKeys | None) -> APIKeys:
    """create_app's `api_key`: one key, several, an APIKeys, or None/'' for no auth."""
    if isinstance(api_key, APIKeys):
        return api_key
    if api_key is None or api_key == "":
        return APIKeys()
    keys = [api_key] if isinstance(api_key, str) else [k for k in api_key if k]
    return APIKeys(keys, [("the api_key argument", len(keys))])
