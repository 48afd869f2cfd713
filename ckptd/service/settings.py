"""Service configuration: ``CKPTD_*`` environment variables, overridden by flags.

The configuration table in README.md is generated from :class:`Settings`
(environment variable, ``ckptd serve`` flag, default, description). After adding
or changing a field, regenerate it with the one command::

    .venv/bin/python -m ckptd.service.settings --readme README.md

(``--markdown`` prints the table instead.) ``tests/test_settings.py`` fails while
the README's table differs from the generated one. Give every field a
``description``: it is the table's "meaning" column.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings", "markdown_table", "update_readme"]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CKPTD_", extra="ignore")

    root: str = Field("./ckptd-data", description="storage root: a directory or an fsspec URL (s3://bucket/prefix)")
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8470, description="port to listen on")
    stale_session_ttl: float = Field(6 * 3600.0, description="seconds before an uncommitted session is reclaimed")
    reclaim_interval: float = Field(600.0, description="seconds between stale-session sweeps")
    max_index_bytes: int = Field(
        64 << 20, description="largest accepted rank index or read-plan body (a one-rank index of 1,024 ranks x 500 "
        "tensors, as `ckptd import dcp` sends, is about 26 MB; parsing and checking an index costs up to 20 times "
        "its size in memory)")
    write_batch_bytes: int = Field(8 << 20, description="bytes gathered before each storage write")
    reshard_workers: int = Field(1, description="worker processes for reshard jobs")
    reshard_max_mbps: float = Field(256.0, description="bandwidth cap of one reshard job, MiB/s (0 = none)")
    retention_keep_last: int | None = Field(
        None, ge=1, description="retention policy: after each commit keep the N newest steps of its run (unset: "
        "keep everything; `ckptd gc` still works)")
    retention_keep_every: int | None = Field(
        None, ge=1, description="retention policy: also keep every step that is a multiple of K")
    read_lease_seconds: float = Field(
        900.0, ge=0, description="serving a manifest leases that checkpoint this long, so gc spares it (0 = off)")
    log_level: str = Field("info", description="log level")
    log_format: Literal["text", "json"] = Field(
        "text", description="log lines as text or as JSON objects (one per line, with request ids)")
    tokens_file: str | None = Field(
        None, description="file of bearer tokens and their scopes (README: Authentication); re-read when it changes")
    tokens: SecretStr | None = Field(
        None, description="bearer tokens inline, in the tokens-file format (`;` separates lines)")
    insecure_open: bool = Field(
        False, description="serve without tokens on a non-loopback address (anyone who can reach it may read "
                           "and write)")
    verify_after_commit: bool = Field(
        False, description="after each commit, re-read and check the checkpoint in a worker process (as `ckptd "
        "verify` does) and record the outcome (`GET .../verification`)")
    direct_reads: bool = Field(
        True, description="when the root is a local directory, give loading clients each data file's path so that "
        "ranks on this host (or on a shared filesystem mounted at the same path) read the bytes themselves, with "
        "the same block checks, instead of through HTTP")
    direct_writes: bool = Field(
        True, description="when the root is a local directory, let saving ranks that share this filesystem write "
        "their data files into the session's directory themselves; the service hashes every byte of each file "
        "before it accepts it (`POST .../files/{file}/adopt`), as it hashes an upload")
    max_header_bytes: int = Field(64 << 10, description="largest accepted request line plus headers (431 beyond)")
    header_timeout_seconds: float = Field(
        30.0, ge=0, description="seconds a connection has to send a request's line and headers, from when it "
        "opens or the request's first byte arrives; then it is closed (0 = no limit)")
    body_idle_timeout_seconds: float = Field(
        60.0, ge=0, description="seconds a request body may send nothing while the service waits for it; then it "
        "is answered 408 and closed (0 = no limit)")
    send_idle_timeout_seconds: float = Field(
        60.0, ge=0, description="seconds a response may wait for its client to read any of it (the socket's send "
        "buffer full); then the connection is closed (0 = no limit). Over the connection cap, such connections "
        "are closed before busy ones")
    max_connections: int = Field(
        4096, ge=16, description="open client connections at most, and never more than the file-descriptor limit "
        "(`ulimit -n`) less an eighth of it; a new one beyond closes the longest-idle connection without a "
        "request in progress (or itself, if every one is busy), so idle sockets cannot starve probes")
    max_uploads_per_principal: int = Field(
        64, ge=0, description="file uploads and adopts one token may have in progress at once; more are "
        "refused 429, which clients retry (0 = no limit)")
    read_plan_chunk_budget: int = Field(
        1 << 20, ge=0, description="chunks a read plan may visit (requests x chunks of the tensor each names), "
        "plus 16 per byte of its request; more is refused 413 before any work")
    read_plan_answer_budget: int = Field(
        1 << 16, ge=0, description="copies plus fetches a read plan may answer, plus 1 per byte of its request; "
        "more is refused 413")


# -- the README's configuration table -------------------------------------------------------------

TABLE_BEGIN = "<!-- BEGIN settings table: generated by `python -m ckptd.service.settings --readme README.md` -->"
TABLE_END = "<!-- END settings table -->"


def env_name(name: str) -> str:
    """The environment variable that sets field ``name``."""
    from pydantic import AliasChoices

    field = Settings.model_fields[name]
    alias = field.validation_alias or field.alias
    if isinstance(alias, AliasChoices):
        alias = next((a for a in alias.choices if isinstance(a, str)), None)
    if isinstance(alias, str):
        return alias.upper()
    return f"{Settings.model_config.get('env_prefix', '')}{name}".upper()


def serve_flags() -> dict[str, str]:
    """Field name -> the ``ckptd serve`` flag that overrides it (from the CLI's own parser)."""
    from ..cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    serve = sub.choices["serve"]  # type: ignore[attr-defined]
    return {a.dest: max(a.option_strings, key=len) for a in serve._actions
            if a.option_strings and a.dest in Settings.model_fields}


def _default(value: object) -> str:
    import json
    from pathlib import PurePath

    from pydantic import SecretBytes, SecretStr

    if value is None:
        return "unset"
    if isinstance(value, (SecretStr, SecretBytes)):
        return "hidden"
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float) and value.is_integer():
        text = str(int(value))
    elif isinstance(value, (str, int, float, PurePath)):
        text = str(value)
    else:
        text = json.dumps(value, default=str)
    return f"`{text}`" if text else '`""`'


def markdown_table() -> str:
    """The configuration table, one row per :class:`Settings` field, in declaration order."""
    flags = serve_flags()
    rows = ["| variable | `ckptd serve` flag | default | meaning |", "| --- | --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        default = field.get_default(call_default_factory=True)
        meaning = (field.description or "").replace("|", "\\|").replace("\n", " ")
        flag = f"`{flags[name]}`" if name in flags else ""
        rows.append(f"| `{env_name(name)}` | {flag} | {_default(default)} | {meaning} |")
    return "\n".join(rows) + "\n"


def update_readme(text: str) -> str:
    """``text`` with the part between the table markers replaced by :func:`markdown_table`."""
    start, end = text.find(TABLE_BEGIN), text.find(TABLE_END)
    if start < 0 or end < start:
        raise ValueError(f"README has no settings table markers ({TABLE_BEGIN!r} ... {TABLE_END!r})")
    start += len(TABLE_BEGIN)
    return f"{text[:start]}\n{markdown_table()}{text[end:]}"


def _main(argv: list[str] | None = None) -> int:
    import argparse
    from pathlib import Path

    p = argparse.ArgumentParser(prog="python -m ckptd.service.settings",
                                description="Generate the README's configuration table from Settings.")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--markdown", action="store_true", help="print the table")
    g.add_argument("--readme", metavar="PATH", help="rewrite the table in PATH (between its markers)")
    args = p.parse_args(argv)
    if args.markdown:
        print(markdown_table(), end="")
        return 0
    path = Path(args.readme)
    old = path.read_text(encoding="utf-8")
    new = update_readme(old)
    if new != old:
        path.write_text(new, encoding="utf-8")
    print(f"{path}: settings table {'updated' if new != old else 'already up to date'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
