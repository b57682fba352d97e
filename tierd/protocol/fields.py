"""Small typed readers for decoded msgpack maps; each failure names the field path."""

from __future__ import annotations

from typing import Any

from tierd.protocol.errors import ErrorCode, ProtocolError

MAX_NAME_LEN = 256


def bad(path: str, what: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, f"{path}: {what}")


def get(body: dict, name: str, path: str, default: Any = ...) -> Any:
    if name in body:
        return body[name]
    if default is ...:
        raise bad(f"{path}.{name}" if path else name, "missing")
    return default


def as_int(value: Any, path: str, lo: int | None = None, hi: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad(path, f"expected an integer, got {type(value).__name__}")
    if lo is not None and value < lo:
        raise bad(path, f"{value} is below the minimum {lo}")
    if hi is not None and value > hi:
        raise bad(path, f"{value} is above the maximum {hi}")
    return value


def as_float(value: Any, path: str, lo: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(path, f"expected a number, got {type(value).__name__}")
    if lo is not None and value < lo:
        raise bad(path, f"{value} is below the minimum {lo}")
    return float(value)


def as_str(value: Any, path: str, max_len: int = MAX_NAME_LEN, allow_empty: bool = True) -> str:
    if not isinstance(value, str):
        raise bad(path, f"expected a string, got {type(value).__name__}")
    if len(value) > max_len:
        raise bad(path, f"longer than {max_len} characters")
    if not allow_empty and not value:
        raise bad(path, "must not be empty")
    if "\x00" in value:
        raise bad(path, "must not contain NUL")
    return value


def as_bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise bad(path, f"expected a boolean, got {type(value).__name__}")
    return value


def as_bytes(value: Any, path: str, min_len: int, max_len: int) -> bytes:
    if not isinstance(value, bytes):
        raise bad(path, f"expected binary, got {type(value).__name__}")
    if not min_len <= len(value) <= max_len:
        raise bad(path, f"length {len(value)} outside [{min_len}, {max_len}]")
    return value


def as_list(value: Any, path: str, max_len: int, min_len: int = 0) -> list:
    if not isinstance(value, list):
        raise bad(path, f"expected an array, got {type(value).__name__}")
    if not min_len <= len(value) <= max_len:
        raise bad(path, f"length {len(value)} outside [{min_len}, {max_len}]")
    return value


def as_map(value: Any, path: str) -> dict:
    if not isinstance(value, dict):
        raise bad(path, f"expected a map, got {type(value).__name__}")
    return value


def as_choice(value: Any, path: str, choices: tuple[str, ...]) -> str:
    value = as_str(value, path)
    if value not in choices:
        raise bad(path, f"{value!r} is not one of {', '.join(choices)}")
    return value
