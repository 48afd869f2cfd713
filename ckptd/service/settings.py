"""Service configuration: ``CKPTD_*`` environment variables, overridden by flags.

The configuration table of the docs is generated from :class:`Settings` by
:mod:`ckptd.cli.settings_table` (environment variable, ``ckptd serve`` flag, default,
description); give every field a ``description``: it is the table's "meaning" column.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator
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
    stale_session_ttl: float = Field(6 * 3600.0, description="seconds after opening when an uncommitted session is reclaimed, however active")
    dead_session_after: float = Field(
        300.0, ge=1.0, description="seconds an uncommitted session may go without a live writer (a rank's write or "
        "keep-alive) before the sweep aborts it and deletes its staged bytes")
    reclaim_interval: float = Field(120.0, description="seconds between stale-session sweeps")
    max_index_bytes: int = Field(
        64 << 20, description="largest accepted rank index (a one-rank index of 1,024 ranks x 500 "
        "tensors, as `ckptd import dcp` sends, is about 26 MB; parsing and checking an index costs up to 20 times "
        "its size in memory); read-plan and load-tree bodies have their own, smaller limit "
        "(CKPTD_READ_PLAN_MAX_REQUESTS). An index is stored with its files' records in at most 256 MiB (the "
        "largest object of rank indexes a commit reads), whatever this says")
    write_batch_bytes: int = Field(8 << 20, description="bytes gathered before each storage write")
    reshard_workers: int = Field(1, description="worker processes for reshard jobs")
    reshard_max_mbps: float = Field(256.0, description="bandwidth cap of one reshard job, MiB/s (0 = none)")
    job_heartbeat_seconds: float = Field(
        15.0, gt=0, description="seconds between a replica's heartbeats (`jobs/replicas/`) while its worker pool "
        "holds reshard jobs or drills, and between its sweeps for jobs whose replica stopped")
    job_takeover_seconds: float = Field(
        120.0, gt=0, description="a queued or running reshard job or drill whose replica's heartbeat is older than "
        "this (or gone: it shut down), and whose record has not changed for as long, is taken over by a live "
        "replica: a drill is resumed, a reshard job is failed (\"the service stopped while this job ran\"; done "
        "when its output had committed) (docs/resharding.md, Jobs after a crash); at least twice "
        "CKPTD_JOB_HEARTBEAT_SECONDS")
    drill_every: int = Field(
        0, ge=0, description="conversion drill policy: after every N commits of trainer checkpoints of a run "
        "(counted by each replica since it started), drill the run's newest checkpoint (`RUN/latest`) into "
        "CKPTD_DRILL_LAYOUTS in a worker process at low priority, as `ckptd drill` does, and record the outcome "
        "(`GET .../drill`, `ckptd_drills_total`); a run whose previous drill is still running skips its turn "
        "(0 = off)")
    drill_layouts: str = Field(
        "half,double,full", description="the layouts the drill policy converts to, comma-separated: layout specs "
        "(`full`, `fsdp2:dp=4`, `zero3:dp=8,align=16`: a piece starting with `dp=`, `align=`, `max-per-rank=` or "
        "`group=` continues the spec before it), or `half` / `double`: `fsdp2` at half (at least 1) or twice the "
        "source's data-parallel degree D, the product of its mesh's `dp` and `dp_*` dimensions, or else its world "
        "size over its `tp`, `pp`, `cp` and `ep` dimensions (docs/resharding.md, Conversion drills)")
    retention_keep_last: int | None = Field(
        None, ge=1, description="retention policy: after each commit keep the N newest steps of its run (unset: "
        "keep everything; `ckptd gc` still works)")
    retention_keep_every: int | None = Field(
        None, ge=1, description="retention policy: also keep every step that is a multiple of K")
    read_lease_seconds: float = Field(
        900.0, ge=0, description="a reader's lease runs this long unless renewed, and file bytes served to a request "
        "that names no lease of its own keep the checkpoint from gc this long after the read (to within 30 s); "
        "reading metadata takes no lease (0 = leases off)")
    read_leases_per_token: int = Field(
        100_000, ge=1, description="the most unexpired read leases one token may hold at a replica (a load takes "
        "one per rank; 429 past it)")
    log_level: Literal["debug", "info", "warning", "error", "critical"] = Field("info", description="log level")
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
        "verify` does) and record the outcome (`GET .../verification`); a commit that did not read every byte "
        "(checked as they arrived) is re-read so whatever this says")
    verify_before_visible: bool = Field(
        False, description="read every byte of a checkpoint back and check it before its marker, even bytes "
        "checked as they arrived (the commit then lags by the checkpoint's read time); by default they are "
        "confirmed by their stored identity and re-read after the marker, the checkpoint pending until then")
    direct_reads: bool = Field(
        True, description="when the root is a local directory, give loading clients each data file's path so that "
        "ranks on this host (or on a shared filesystem mounted at the same path) read the bytes themselves, with "
        "the same block checks, instead of through HTTP")
    direct_uploads: bool = Field(
        False, description="opt-in: on an object store root (S3), give saving ranks presigned URLs to upload their "
        "data files to it straight (`POST .../files/{file}/presign`, then `.../confirm`), each read back and checked "
        "before the checkpoint is visible; off, every byte goes through the service, checked as it arrives")
    local_uploads: bool = Field(
        True, description="let saving ranks on this host hand each data file over as a sealed memory file through "
        "a Unix socket (named in each session's answer) instead of an HTTP body: the same checks, a fraction of the "
        "service's CPU per byte")
    direct_upload_seconds: float = Field(
        900.0, gt=0, le=7 * 86400, description="how long a presigned upload URL stays valid")
    root_reserve: str = Field(
        "1%", description="free space a local root keeps for the commits of saves in progress: a size (`4GiB`) or "
        "a percentage of its filesystem (`5%`); a data file's bytes, or a new session, that would take the free "
        "space below it are refused with 507 `reserve_reached`, while rank indexes, manifests and markers are still "
        "written, so a save whose data has arrived commits (docs/security.md, Quotas and the reserve; 0 = no reserve; object stores "
        "have none)")
    max_header_bytes: int = Field(64 << 10, description="largest accepted request line plus headers (431 beyond)")
    header_timeout_seconds: float = Field(
        30.0, ge=0, description="seconds a connection has to send a request's line and headers, from when it "
        "opens or the request's first byte arrives; then it is closed (0 = no limit)")
    body_idle_timeout_seconds: float = Field(
        60.0, ge=0, description="seconds a request body may send nothing while the service waits for it; then it "
        "is answered 408 and closed (0 = no limit)")
    body_min_bytes_per_second: float = Field(
        1024.0, ge=0, description="slowest average a request body may arrive at, counted over the time the "
        "service waits for it (a storage write that pauses reading does not count); a body further behind it "
        "than CKPTD_BODY_RATE_GRACE_SECONDS is answered 408 and closed, so a trickled body is shed within about "
        "that grace. 1 KiB/s is far below any real upload, even 32 streams sharing 1 Mbit/s (0 = no minimum)")
    body_rate_grace_seconds: float = Field(
        30.0, ge=0, description="seconds a request body may fall behind CKPTD_BODY_MIN_BYTES_PER_SECOND (at its "
        "start, or after a fast start); a body that has been arriving faster may pause for as long as "
        "CKPTD_BODY_IDLE_TIMEOUT_SECONDS allows")
    send_idle_timeout_seconds: float = Field(
        60.0, ge=0, description="seconds a response may wait for its client to read any of it (the socket's send "
        "buffer full); then the connection is closed (0 = no limit). Over the connection cap, such connections "
        "are closed before busy ones")
    max_connections: int = Field(
        4096, ge=16, description="open client connections at most, and never more than the file-descriptor limit "
        "(`ulimit -n`) less an eighth of it. A new one beyond closes the longest-idle connection without a "
        "request in progress; failing that, the one whose response has waited longest for its client to read; "
        "failing that, the one whose request body is furthest behind CKPTD_BODY_MIN_BYTES_PER_SECOND (answered "
        "503, which clients retry). When every one is busy otherwise, 16 connections more are kept for "
        "`/healthz` and `/readyz` only (any other request on them is answered 503), so probes are answered "
        "under any load")
    max_requests_per_principal: int = Field(
        2048, ge=0, description="requests of every kind one token may have in progress at once (probes, "
        "metrics and requests without a token are not counted); more are refused 429, which clients retry. "
        "A job's ranks share its token: a 1,024-rank save holds about 1,100 (one status long-poll per rank, "
        "plus the uploads CKPTD_MAX_UPLOADS_PER_PRINCIPAL lets through); keep it under CKPTD_MAX_CONNECTIONS so "
        "that one token cannot hold every connection (0 = no limit)")
    max_uploads_per_principal: int = Field(
        64, ge=0, description="file uploads one token may have in progress at once; more are "
        "refused 429, which clients retry (0 = no limit)")
    manifest_cache_bytes: int = Field(
        1 << 30, ge=0, description="memory the parsed manifests kept for reads may take (about 6 bytes per byte of "
        "manifest JSON, their load trees and interval indexes included; ckptd_manifest_cache_bytes on /metrics); "
        "the least recently read go first, the one in use always stays")
    read_plan_max_requests: int = Field(
        16384, ge=1, description="regions one read-plan or load-tree request may name (and object names one "
        "load-tree request may name); its body may be 256 bytes per region, 4 MiB at the default. A rank names "
        "one region per piece of a tensor it loads (a few thousand for a large model, whatever the world size); "
        "the client sends more as several requests, split by the limit a 413 names. More is refused 413 before "
        "the body is parsed")
    list_max_items: int = Field(
        1000, ge=1, description="items one listing answer holds at most (GET /v1/runs, GET /v1/runs/{run}/checkpoints), "
        "its default page: a page reads the markers and records of at most this many checkpoints (of a run's "
        "names, in name order), or lists at most this many runs; X-Ckptd-Next names where the next page starts "
        "(?after=NAME), and the client follows it. A larger ?limit= is refused 413")
    read_plan_chunk_budget: int = Field(
        1 << 20, ge=0, description="chunks a read plan or load-tree request may visit (the chunks each requested "
        "region may meet, found through the tensor's interval index), plus 64 per region it names (a load-tree "
        "answer holds at most as many chunk rows); more is refused 413 before any work")
    read_plan_answer_budget: int = Field(
        1 << 16, ge=0, description="copies plus fetches a read plan may answer, plus 2 per region it names; more "
        "is refused 413")

    @field_validator("log_level", mode="before")
    @classmethod
    def _level_any_case(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @field_validator("root", "durable")
    @classmethod
    def _openable(cls, value: str | None) -> str | None:
        """A URL whose scheme has no storage backend here is refused with the flags, not at start-up."""
        from ..storage import check_scheme

        if value is not None:
            check_scheme(value)
        return value

    @field_validator("drill_layouts")
    @classmethod
    def _drill_layouts(cls, value: str) -> str:
        from ckptd_schemas import InvalidRequest

        from ..reshard.drill_layouts import check_layout, split_layouts

        layouts = split_layouts(value)
        if not layouts:
            raise ValueError("names no layout")
        for layout in layouts:
            try:
                check_layout(layout)
            except InvalidRequest as e:  # its message names the grammar
                raise ValueError(e.message) from None
        return value

    @field_validator("root_reserve")
    @classmethod
    def _root_reserve(cls, value: str) -> str:
        from ..store.space import parse_reserve

        parse_reserve(value)  # its ValueError names the grammar
        return value

    @field_validator("job_takeover_seconds")
    @classmethod
    def _takeover_after_heartbeats(cls, value: float, info: ValidationInfo) -> float:
        beat = info.data.get("job_heartbeat_seconds")
        if beat is not None and value < 2 * beat:
            raise ValueError(f"must be at least twice CKPTD_JOB_HEARTBEAT_SECONDS ({beat:g}), or a live replica's "
                             f"jobs would be taken over")
        return value

    def storage_url(self) -> str:
        """What the service opens: the root, or the root as the fast tier in front of ``durable``."""
        return self.root if self.durable is None else f"tiered:{self.root}|{self.durable}"


#: The settings by what they govern: the configuration table shows one group after another.
GROUPS: dict[str, tuple[str, ...]] = {
    "Service": ("root", "durable", "fast_keep_last", "durable_scan_seconds", "host", "port", "log_level", "log_format"),
    "Authentication": ("tokens_file", "tokens", "insecure_open"),
    "Saving and loading": ("direct_uploads", "direct_upload_seconds", "local_uploads", "direct_reads",
                           "write_batch_bytes", "root_reserve", "manifest_cache_bytes", "verify_after_commit", "verify_before_visible", "stale_session_ttl", "dead_session_after",
                           "reclaim_interval"),
    "Retention and leases": ("retention_keep_last", "retention_keep_every", "read_lease_seconds",
                             "read_leases_per_token"),
    "Reshard jobs": ("reshard_workers", "reshard_max_mbps", "job_heartbeat_seconds", "job_takeover_seconds"),
    "Conversion drills": ("drill_every", "drill_layouts"),
    "Request limits": ("max_index_bytes", "max_header_bytes", "header_timeout_seconds", "body_idle_timeout_seconds",
                       "body_min_bytes_per_second", "body_rate_grace_seconds", "send_idle_timeout_seconds",
                       "max_connections", "max_requests_per_principal", "max_uploads_per_principal",
                       "read_plan_max_requests", "read_plan_chunk_budget", "read_plan_answer_budget", "list_max_items"),
}


def env_name(name: str) -> str:
    """The environment variable that sets field ``name`` (no field has an alias)."""
    return f"{Settings.model_config['env_prefix']}{name}".upper()
