"""Service configuration: ``CKPTD_*`` environment variables, overridden by flags.

The configuration table of the docs is generated from :class:`Settings` by
:mod:`ckptd.cli.settings_table` (environment variable, ``ckptd serve`` flag, default,
description); give every field a ``description``: it is the table's "meaning" column.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["GROUPS", "Settings", "env_name"]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CKPTD_", extra="ignore")

    root: str = Field("./ckptd-data", description="storage root: a directory or an fsspec URL (s3://bucket/prefix)")
    durable: str | None = Field(
        None, description="durable tier behind the root (a directory or an fsspec URL such as s3://bucket/prefix): "
        "saves commit on the root (the fast tier, e.g. local NVMe) and each committed checkpoint is then copied "
        "here, every byte checked, and marked durable (docs/deployment.md, Fast tier); loads read the fast tier "
        "first and fall back to this one")
    fast_keep_last: int = Field(
        2, ge=1, description="with a durable tier: the fast tier keeps each run's N newest checkpoints; older "
        "ones leave it once durable (the durable tier follows the retention policy)")
    durable_scan_seconds: float = Field(
        10.0, gt=0, description="with a durable tier: seconds between scans for committed checkpoints not yet "
        "durable (each commit here starts one at once; the scan finds other replicas' commits and what a crash "
        "left)")
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8470, ge=0, le=65535, description="port to listen on (0: any free port)")
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
        None, description="file of bearer tokens and their scopes (docs/security.md, Tokens); re-read when it changes")
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
    direct_uploads: bool = Field(
        True, description="when the root is an object store (S3), give saving ranks presigned URLs to upload their "
        "data files to it straight (`POST .../files/{file}/presign`, then `.../confirm`); the commit reads and "
        "checks every byte of each such file before the checkpoint is visible")
    direct_upload_seconds: float = Field(
        900.0, gt=0, le=7 * 86400, description="how long a presigned upload URL stays valid")
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

    def storage_url(self) -> str:
        """What the service opens: the root, or the root as the fast tier in front of ``durable``."""
        return self.root if self.durable is None else f"tiered:{self.root}|{self.durable}"


#: The settings by what they govern: the configuration table shows one group after another.
GROUPS: dict[str, tuple[str, ...]] = {
    "Service": ("root", "durable", "fast_keep_last", "durable_scan_seconds", "host", "port", "log_level", "log_format"),
    "Authentication": ("tokens_file", "tokens", "insecure_open"),
    "Saving and loading": ("direct_writes", "direct_uploads", "direct_upload_seconds", "direct_reads",
                           "write_batch_bytes", "verify_after_commit", "stale_session_ttl", "reclaim_interval"),
    "Retention and leases": ("retention_keep_last", "retention_keep_every", "read_lease_seconds"),
    "Reshard jobs": ("reshard_workers", "reshard_max_mbps"),
    "Request limits": ("max_index_bytes", "max_header_bytes", "header_timeout_seconds", "body_idle_timeout_seconds",
                       "send_idle_timeout_seconds", "max_connections", "max_uploads_per_principal",
                       "read_plan_chunk_budget", "read_plan_answer_budget"),
}


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
