"""Relay mode and relayed hops: opaque length-prefixed frames over libp2p circuits."""
