"""Service configuration: ``CKPTD_*`` environment variables, overridden by flags."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings"]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CKPTD_", extra="ignore")

    root: str = Field("./ckptd-data", description="storage root: a directory or an fsspec URL (s3://bucket/prefix)")
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8470, description="port to listen on")
    stale_session_ttl: float = Field(6 * 3600.0, description="seconds before an uncommitted session is reclaimed")
    reclaim_interval: float = Field(600.0, description="seconds between stale-session sweeps")
    max_index_bytes: int = Field(256 << 20, description="largest accepted rank index or read-plan body")
    write_batch_bytes: int = Field(8 << 20, description="bytes gathered before each storage write")
    reshard_workers: int = Field(1, description="worker processes for reshard jobs")
    reshard_max_mbps: float = Field(256.0, description="bandwidth cap of one reshard job, MiB/s (0 = none)")
    log_level: str = Field("info", description="log level")
