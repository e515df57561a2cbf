"""Every change meshd makes inside py-libp2p, behind one version gate.

Each adjustment reaches into the library as it is in one release
(``gate.TESTED_LIBP2P_VERSION``), passes ``gate.gate`` first, and is
recorded in ``registry`` (what ``meshd status`` lists: name, on/off, why).
Nothing here runs at import: the host builder (dht/host/build.py) applies
the host-wide patches before the first host exists; the others are applied
by the code that owns the library object and recorded through
``registry.decide``.

    gate.py              TESTED_LIBP2P_VERSION, installed_version(), gate(): the one gate
    registry.py          Adjustment records, apply_libp2p_adjustments(), status rows

Host-wide patches (one module each; status name -> what, upstream):

    yamux_release_on_read  release_on_read.py: the library's PY_YAMUX_RELEASE_ON_READ knob set to 0
                           https://github.com/libp2p/py-libp2p/pull/1337 added the per-read updates
    yamux_window_batching  yamux_window.py: WINDOW_UPDATEs at half the window (go-yamux's rule)
                           https://github.com/libp2p/py-libp2p/pull/1337 (same)
    libp2p_fastpath        lean_datapath.py: leaner TCP/Noise/yamux data path, same bytes on the wire
                           (MESHD_LIBP2P_FASTPATH=0 leaves it off); no upstream issue found
    inbound_limits         inbound_limits.py: per-address caps on pending and upgraded inbound
                           connections, a 5 s pre-handshake deadline (MESHD_INBOUND_LIMITS=0);
                           nearest upstream https://github.com/libp2p/py-libp2p/issues/553
    dial_head_start        dial_head_start.py: no fixed 250 ms wait in every new dial
                           (MESHD_DIAL_HEAD_START=0); no upstream issue found
    no_auto_connect        no_auto_connect.py: the swarm's AutoConnector dials nobody
                           (MESHD_NO_AUTO_CONNECT=0); https://github.com/libp2p/py-libp2p/issues/1451
    peer_record_gc         peer_record_gc.py: an expired address-book entry no longer makes KadDHT
                           reset requests (MESHD_PEER_RECORD_GC=0); no upstream issue found, the
                           raise is https://github.com/libp2p/py-libp2p/issues/371's TTL check

Adjustments recorded by their owners (``registry.decide``):

    dht_inbound_handlers   dht/node.py: KadDHT serves 64 inbound DHT streams at once, not 12
                           (``KadDHT._inbound_limiter``); no upstream issue found
    dht_maintenance        dht/node.py: KadDHT's 10-minute maintenance loop (``_run_main_loop``)
                           replaced by DhtNode's jittered refresh; no upstream issue found
    dcutr_policy           meshd/reach/direct_upgrade.py: the DCUtR service narrowed (no auto-drive,
                           no relay close, bounded inbound punches); no upstream issue found
    mdns_broadcaster       mdns_broadcaster.py, used by dht/host/mdns.py: libp2p's PeerBroadcaster
                           announces the interfaces mDNS runs on, not the route to 8.8.8.8
                           (MESHD_MDNS_BROADCASTER=0); the module says what else of the library's
                           mDNS meshd does not use and why; https://github.com/libp2p/py-libp2p/issues/1419

Each module's docstring says why, what it replaces in the library, and its
upstream link.
"""
