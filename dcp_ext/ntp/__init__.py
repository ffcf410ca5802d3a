"""Nonuniform tensor parallelism (NTP): row layouts and in-place checkpoint handles."""

from dcp_ext.ntp.layout import NonuniformTP, Range
from dcp_ext.ntp.shard import NTPShard, ntp_shard

__all__ = ["NTPShard", "NonuniformTP", "Range", "ntp_shard"]
