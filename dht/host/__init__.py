"""A node's libp2p host: built one way for every process, below the DHT and the relay role.

Both dht/ (DhtNode wraps KadDHT on a host) and relay/ (circuits, the hop)
run on a host, so building it lives here, under both; it imports only
dht/compat (the library patches it applies first), dht/identity.py and
proto's error root -- never the records or Kademlia code beside it.

    build.py        build_host (Noise only, yamux only, adjustments applied first),
                    running_host (listen exactly where told; connections closed on exit)
    bootstrap.py    connect_bootstrap: dial the bootstrap peers in rounds, each under a timeout
    conn_watch.py   ConnectionWatch: the swarm's connect/disconnect notifications as trio events
    swarm_scope.py  SwarmScope: a swarm name and what it scopes (mDNS instance names, the DHT protocol id)
    interfaces.py   this machine's IPv4 interfaces: where mDNS may run, which address a wildcard
                    listener offers peers
    mdns_core.py    mDNS discovery without I/O: which announcements are ours, whom to dial when
    mdns.py         MdnsDiscovery: announce us, find our swarm's LAN peers, dial them (zeroconf)
    errors.py       HostError tree: ListenAddressInvalid, PortInUse, BootstrapUnreachable, SwarmNameInvalid
"""
