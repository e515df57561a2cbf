"""Daemon configuration: one frozen dataclass, from a TOML file with CLI flags on top.

Data flow: ``load_config(path, overrides)`` reads the TOML file (``tomllib``),
lays the command-line overrides (only the flags the user actually gave) over
it, and builds ``DaemonConfig``, which validates everything at construction.
Nothing else in the daemon reads files or flags; modules receive the config
(or a field of it).

TOML layout: top-level keys are ``DaemonConfig``'s fields, ``[worker]`` holds
``WorkerConfig``'s (``threads`` is ``torch_threads``), ``[api]`` ``ApiConfig``'s;
every key is optional and an unknown one is refused. The whole layout, with
the flag that sets each key, is in docs/configuration.md.
"""
from __future__ import annotations

import ipaddress
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dht.host.errors import SwarmNameInvalid
from dht.host.swarm_scope import DEFAULT_SWARM_NAME, SwarmScope
from meshd.errors import ConfigError

DEFAULT_DATA_DIR = Path("~/.local/share/meshd")
# libp2p's conventional port; loopback-only unless the user says otherwise
# would make a useless swarm node, so the default listens on all IPv4 interfaces.
DEFAULT_LISTEN = ("/ip4/0.0.0.0/tcp/4001",)
# Records live two minutes: long enough to ride out a republish that is a few
# seconds late, short enough that a crashed node leaves the coverage map soon.
DEFAULT_RECORD_TTL_S = 120.0
# Bounds on the TTL: under 2 s republishing would dominate the DHT traffic;
# over an hour a dead node would stay on the map far too long.
MIN_RECORD_TTL_S = 2.0
MAX_RECORD_TTL_S = 3600.0
# When a failure leaves some layers without any live server, the entry's route driver waits for the
# tracker to refill them: the dead peers' records must expire (up to one record TTL), the tracker
# confirms the gap over three of its 3 s refreshes and a redundant node loads the range. The default
# wait (refill_wait_s unset) is one record TTL plus REFILL_SLACK_S for the rest; a wait longer
# than an hour is never useful (the API's own deadline is 10 minutes by default).
REFILL_SLACK_S = 60.0
MAX_REFILL_WAIT_S = 3600.0
# A worker loads weights and runs a validation forward before it is ready.
DEFAULT_WORKER_READY_TIMEOUT_S = 900.0
# KV positions a worker holds (one 2048-token context for two concurrent
# sessions). ONE setting (worker.kv_budget_tokens) for both sides: the planner
# sizes a node's range with it (meshd/plan: weights + this KV + scratch within
# --memory) and the worker admits sessions against exactly it (shard/session/sessions.py),
# so --memory is never exceeded by KV the plan did not count.
DEFAULT_KV_BUDGET_TOKENS = 4096
# Restart backoff for a dead worker: doubles from the first to the cap (about 5
# minutes: a crash loop costs a start every 5 min, a fixed model file is
# picked up within that), and starts over once a worker has served this long
# (a failure after that is news, not a crash loop).
DEFAULT_RESTART_BACKOFF_S = 1.0
DEFAULT_RESTART_BACKOFF_MAX_S = 300.0
DEFAULT_RESTART_BACKOFF_RESET_S = 120.0
# How long to wait for each bootstrap peer before calling it unreachable.
DEFAULT_BOOTSTRAP_TIMEOUT_S = 15.0
MAX_BOOTSTRAP_PEERS = 64
WORKER_DTYPES = ("float32", "bfloat16")
# A worker never gets more compute threads than this (a typo like 400 would
# oversubscribe any machine badly; 256 covers the biggest servers).
MAX_WORKER_THREADS = 256
WORKER_BACKENDS = ("torch", "llama.cpp")
# llama.cpp's LLAMA_MAX_SEQ: per-session KV streams one context can hold.
MAX_LLAMA_KV_STREAMS = 256
# auto: ask connected peers to dial us back (relay/reachability.py) and use relays
# only when they cannot; public/private skip the probe (private forces relaying).
REACHABILITY_MODES = ("auto", "public", "private")
# How the entry drives a route (meshd/generate/push.py); push is the default: fewer network legs.
ROUTE_TOPOLOGIES = ("push", "star")
# Audits (meshd/generate/audit.py): the share of each hop's steps the entry re-runs on another
# replica. A few percent catches a hop that lies on every step within 2/rate of its steps for
# about that much more compute; "all" (1.0) checks every step before its token is streamed.
DEFAULT_VERIFY_RATE = 0.03

# Speculative decoding at this entry (meshd/generate/speculative.py): off, drafting by prompt
# lookup (no model), or by a local draft model (``draft_model``: a GGUF with the model's tokenizer,
# run by llama.cpp at the entry). On, a generation runs on a star route (verify chunks are not
# pushed yet).
SPECULATIVE_MODES = ("off", "prompt-lookup", "draft-model")
EXPERT_ACTS = ("f32", "q8")
# The HTTP API listens on loopback unless told otherwise (secure by default).
DEFAULT_API_LISTEN = "127.0.0.1:8080"
# A bearer key guessed by nobody: at least this many characters.
MIN_API_KEY_CHARS = 16
# Connections the API holds open at once (each is a few KB plus, while it
# streams, one generation); meshd/api/connections.py decides who gets a slot.
DEFAULT_API_MAX_CONNECTIONS = 64
# A key file is a secret: a few hundred bytes at most, its first line is the key.
MAX_API_KEY_FILE_BYTES = 4096
# Uploads to peers that fetch the model from us (meshd/fetch/server.py): a home uplink or a
# LAN keeps room for everything else at 64 MiB/s (about half a gigabit link), and while our
# worker serves a generation the fetch port drops to 8 MiB/s so the generation keeps the CPU
# and the link (its threads also run at the lowest CPU priority). 0: unlimited.
DEFAULT_UPLOAD_BYTES_PER_S = 64 << 20
DEFAULT_UPLOAD_BUSY_BYTES_PER_S = 8 << 20
# `--model NAME@ROOT`: a model named by its Merkle root (meshd/fetch/), with an optional short name.
MODEL_ROOT_RE = re.compile(r"^(?:(?P<name>[A-Za-z0-9][A-Za-z0-9._-]{0,63})@)?(?P<root>merkle:[0-9a-f]{64})$")
# Host names / web origins an operator may list (each at most MAX_NAME_CHARS).
MAX_API_NAMES = 32
MAX_NAME_CHARS = 253


def parse_verify_rate(value: object) -> float:
    """``--verify``: a rate in [0, 1], a percentage ("3%") or "all" (1.0); ConfigError otherwise."""
    if isinstance(value, bool):
        raise ConfigError(f"verify must be a rate in [0, 1], a percentage or \"all\", not {value!r}")
    if isinstance(value, str):
        text = value.strip().lower()
        try:
            rate = 1.0 if text == "all" else float(text[:-1]) / 100 if text.endswith("%") else float(text)
        except ValueError:
            raise ConfigError(f"verify must be a rate in [0, 1], a percentage or \"all\", not {value!r}") from None
    elif isinstance(value, (int, float)):
        rate = float(value)
    else:
        raise ConfigError(f"verify must be a rate in [0, 1], a percentage or \"all\", not {value!r}")
    if not 0.0 <= rate <= 1.0:      # (NaN fails this too)
        raise ConfigError(f"verify must be a rate in [0, 1], a percentage or \"all\", not {value!r}")
    return rate


def split_host_port(text: str) -> tuple[str, int]:
    """``"127.0.0.1:8080"`` / ``"[::1]:8080"`` -> (host, port); the host must be an IP or localhost."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"api listen address must look like HOST:PORT (e.g. 127.0.0.1:8080), not {text!r}")
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError as exc:
            raise ConfigError(f"api listen host must be an IP address or localhost, not {host!r}") from exc
    return host, int(port)


def is_loopback(host: str) -> bool:
    return host == "localhost" or ipaddress.ip_address(host).is_loopback


@dataclass(frozen=True, slots=True)
class ApiConfig:
    # None: the default (DEFAULT_API_LISTEN; if that port is taken the daemon
    # runs without the API and says so); a given address must bind; "off".
    listen: str | None = None
    key: str | None = None
    max_running: int = 4
    max_deferred: int = 16
    deadline_s: float = 600.0
    max_connections: int = DEFAULT_API_MAX_CONNECTIONS
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    # Where the key came from (api.key_file is read by load_config); shown by nothing, kept for messages.
    key_file: str | None = None

    def __post_init__(self) -> None:
        for name in ("allowed_hosts", "cors_origins"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, (list, tuple)) or len(value) > MAX_API_NAMES or \
                    not all(isinstance(v, str) and 0 < len(v) <= MAX_NAME_CHARS and v.isascii()
                            and not any(c.isspace() for c in v) for v in value):
                raise ConfigError(f"api.{name} must be a list of at most {MAX_API_NAMES} names without spaces")
            object.__setattr__(self, name, tuple(v.lower() for v in value))
        for origin in self.cors_origins:
            if not origin.startswith(("http://", "https://")) or origin.count("/") != 2:
                raise ConfigError(f"api.cors_origins: {origin!r} is not an origin like https://app.example[:port]")
        if self.key is not None and (not isinstance(self.key, str) or len(self.key) < MIN_API_KEY_CHARS
                                     or any(c.isspace() for c in self.key)):
            raise ConfigError(f"the api key must be at least {MIN_API_KEY_CHARS} characters, without spaces")
        bind = self.bind
        if bind is not None and not is_loopback(bind[0]) and not self.key:
            raise ConfigError(f"the API would listen on {bind[0]}, beyond loopback: that needs a bearer key "
                              "(--api-key-file PATH, MESHD_API_KEY, or api.key_file in the config); "
                              "or keep it on 127.0.0.1")
        if self.max_running < 1 or self.max_deferred < 0 or self.deadline_s <= 0 or self.max_connections < 1:
            raise ConfigError("api: need max_running >= 1, max_deferred >= 0, deadline_s > 0, max_connections >= 1")

    @property
    def bind(self) -> tuple[str, int] | None:
        if self.listen == "off":
            return None
        return split_host_port(self.listen or DEFAULT_API_LISTEN)

    @property
    def explicit(self) -> bool:
        return self.listen is not None


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    dtype: str = "float32"
    backend: str = "torch"
    kv_budget_tokens: int = DEFAULT_KV_BUDGET_TOKENS
    ready_timeout_s: float = DEFAULT_WORKER_READY_TIMEOUT_S
    restart_backoff_s: float = DEFAULT_RESTART_BACKOFF_S
    restart_backoff_max_s: float = DEFAULT_RESTART_BACKOFF_MAX_S
    restart_backoff_reset_s: float = DEFAULT_RESTART_BACKOFF_RESET_S
    # Compute threads of the worker (torch / llama.cpp): by default every core this process may use.
    torch_threads: int = field(default_factory=lambda: machine_cores())
    # Continuous batching in the worker (shard/session/batching.py); false: one forward at a time.
    batching: bool = True
    # llama.cpp KV layout. N: N streams of kv_budget_tokens / N cells, one per session: bit-exact
    # under concurrency, but at most N sessions of at most that many tokens each. "auto" (the
    # default): N = kv_budget_tokens / 2048, at most 8 (native/factory.py). 0: one pool shared by
    # every session (any session may use the whole budget; a released session's cells are refilled
    # out of order and the running sessions' greedy tokens can drift from the same request alone).
    llama_kv_streams: int | str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.batching, bool):
            raise ConfigError(f"worker.batching must be true or false, not {self.batching!r}")
        streams = self.llama_kv_streams
        if streams != "auto" and (isinstance(streams, bool) or not isinstance(streams, int)
                                  or not 0 <= streams <= MAX_LLAMA_KV_STREAMS):
            raise ConfigError(f"worker.llama_kv_streams must be \"auto\" or an int in 0..{MAX_LLAMA_KV_STREAMS}, "
                              f"not {streams!r}")
        if self.dtype not in WORKER_DTYPES:
            raise ConfigError(f"worker.dtype must be one of {', '.join(WORKER_DTYPES)}, not {self.dtype!r}")
        if self.backend not in WORKER_BACKENDS:
            raise ConfigError(f"worker.backend must be one of {', '.join(WORKER_BACKENDS)}, not {self.backend!r}")
        if not isinstance(self.kv_budget_tokens, int) or self.kv_budget_tokens <= 0:
            raise ConfigError("worker.kv_budget_tokens must be positive")
        if not 0 < self.restart_backoff_s <= self.restart_backoff_max_s:
            raise ConfigError("need 0 < worker.restart_backoff_s <= worker.restart_backoff_max_s")
        if self.restart_backoff_reset_s <= 0:
            raise ConfigError("worker.restart_backoff_reset_s must be positive")
        if self.ready_timeout_s <= 0:
            raise ConfigError("worker.ready_timeout_s must be positive")
        if isinstance(self.torch_threads, bool) or not isinstance(self.torch_threads, int) \
                or not 1 <= self.torch_threads <= MAX_WORKER_THREADS:
            raise ConfigError(f"worker threads must be an integer in 1..{MAX_WORKER_THREADS}, "
                              f"not {self.torch_threads!r}")


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    data_dir: Path = DEFAULT_DATA_DIR
    listen: tuple[str, ...] = DEFAULT_LISTEN
    bootstrap: tuple[str, ...] = ()
    model: Path | None = None
    layers: tuple[int, int] | None = None
    advertise_host: str | None = None
    record_ttl_s: float = DEFAULT_RECORD_TTL_S
    # None: record_ttl_s + REFILL_SLACK_S (``refill_wait`` below); 0: fail at once when a gap opens.
    refill_wait_s: float | None = None
    bootstrap_timeout_s: float = DEFAULT_BOOTSTRAP_TIMEOUT_S
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    # `--layers auto --memory 4GiB`: the tracker assigns the range (meshd/daemon/swarm_part.py).
    auto_layers: bool = False
    memory_bytes: int | None = None
    # `--layers none` (``layers = "none"`` or ``client_only = true``): a client-only node -- no worker,
    # no capability record, never on tracker duty nor assigned a range; it serves generate (control
    # socket, HTTP API) through routes whose every hop is remote (meshd/daemon/swarm_part.py).
    client_only: bool = False
    reachability: str = "auto"
    # push (hops + 1 legs per token); "star" keeps the entry carrying every boundary. Routes push
    # cannot serve (a relayed hop, no certificate pin) run as a star either way (generate/push.py).
    route_topology: str = "push"
    # `--verify RATE|all` (a float in [0, 1], "N%" or "all"): audits of the star routes this node
    # drives (meshd/generate/audit.py); 0 turns them off.
    verify_rate: float = DEFAULT_VERIFY_RATE
    speculative: str = "off"          # SPECULATIVE_MODES; a request may override it ("speculative")
    draft_model: Path | None = None   # `--draft MODEL`: the GGUF the entry drafts with (speculative = draft-model)
    # MoE (meshd/daemon/experts_part.py): the experts held ("L:E0-E7,..." or "auto"), the holder's row format.
    experts: str | None = None
    expert_act: str = "f32"
    offload_experts: bool = False
    # `--model ROOT` / `NAME@ROOT` (set from ``model`` when it names a root, not a path): the node
    # fetches its range's weights from peers (meshd/fetch/) and verifies every byte against it.
    model_root: str | None = None
    model_name: str | None = None
    upload_bytes_per_s: int = DEFAULT_UPLOAD_BYTES_PER_S
    upload_busy_bytes_per_s: int = DEFAULT_UPLOAD_BUSY_BYTES_PER_S
    # The swarm (dht/host/swarm_scope.py): it scopes mDNS and the DHT protocol; "default" when not given.
    swarm: str = DEFAULT_SWARM_NAME
    # LAN discovery by mDNS (dht/host/mdns.py) on the interfaces we listen on; false: --no-mdns.
    mdns: bool = True

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "swarm", SwarmScope(self.swarm).name)
        except SwarmNameInvalid as exc:
            raise ConfigError(str(exc)) from exc
        if not isinstance(self.mdns, bool):
            raise ConfigError(f"mdns must be true or false, not {self.mdns!r}")
        if self.reachability not in REACHABILITY_MODES:
            raise ConfigError(f"reachability must be one of {', '.join(REACHABILITY_MODES)}, "
                              f"not {self.reachability!r}")
        if self.route_topology not in ROUTE_TOPOLOGIES:
            raise ConfigError(f"route_topology must be one of {', '.join(ROUTE_TOPOLOGIES)}")
        object.__setattr__(self, "verify_rate", parse_verify_rate(self.verify_rate))
        if self.draft_model is not None:
            object.__setattr__(self, "draft_model", Path(os.path.expanduser(str(self.draft_model))))
            if self.speculative == "off":
                object.__setattr__(self, "speculative", "draft-model")
        if self.speculative not in SPECULATIVE_MODES:
            raise ConfigError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}")
        if self.speculative == "draft-model" and (self.draft_model is None or not self.draft_model.is_file()):
            raise ConfigError("speculative = draft-model needs draft_model (--draft FILE.gguf), an existing GGUF "
                              "with the served model's tokenizer")
        object.__setattr__(self, "data_dir", Path(os.path.expanduser(str(self.data_dir))).resolve())
        if self.model is not None:
            named = MODEL_ROOT_RE.match(str(self.model))
            if named is not None and not Path(str(self.model)).exists():
                object.__setattr__(self, "model_root", named["root"])
                object.__setattr__(self, "model_name", named["name"])
                object.__setattr__(self, "model", None)
            else:
                object.__setattr__(self, "model", Path(os.path.expanduser(str(self.model))))
        if self.model_root is not None and not MODEL_ROOT_RE.match(self.model_root):
            raise ConfigError(f"model_root must be merkle:<64 hex digits>, not {self.model_root!r}")
        if self.model_root is not None and (self.experts is not None or self.client_only):
            raise ConfigError("--model ROOT fetches a layer range to serve: it does not apply to --experts or "
                              "--layers none (give the model's file)")
        for name in ("upload_bytes_per_s", "upload_busy_bytes_per_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 40:
                raise ConfigError(f"{name} must be a number of bytes per second (0: unlimited)")
        if not self.listen:
            raise ConfigError("listen needs at least one multiaddr, e.g. /ip4/127.0.0.1/tcp/4001")
        for addr in self.listen + self.bootstrap:
            _check_multiaddr(addr)
        if len(self.bootstrap) > MAX_BOOTSTRAP_PEERS:
            raise ConfigError(f"at most {MAX_BOOTSTRAP_PEERS} bootstrap peers")
        for addr in self.bootstrap:
            if "/p2p/" not in addr:
                raise ConfigError(f"bootstrap address {addr} needs its peer id: .../p2p/<peer id>")
        if self.layers is not None:
            start, end = self.layers
            if not 0 <= start < end:
                raise ConfigError(f"layers {start}:{end} must satisfy 0 <= A < B")
        if self.auto_layers and self.layers is not None:
            raise ConfigError("give --layers A:B or --layers auto, not both")
        self._check_client_only()
        self._check_experts()
        expert_peer = self.experts is not None and self.layers is None and not self.auto_layers
        if (not self.has_model) != (self.layers is None and not self.auto_layers and not self.client_only) \
                and not expert_peer:
            raise ConfigError("--model and --layers go together")
        if self.auto_layers and not (self.memory_bytes and self.memory_bytes > 0):
            raise ConfigError("--layers auto needs --memory SIZE (e.g. --memory 4GiB): the range is sized to it")
        if not MIN_RECORD_TTL_S <= self.record_ttl_s <= MAX_RECORD_TTL_S:
            raise ConfigError(f"record_ttl_s must be within [{MIN_RECORD_TTL_S}, {MAX_RECORD_TTL_S}]")
        if self.bootstrap_timeout_s <= 0:
            raise ConfigError("bootstrap_timeout_s must be positive")
        if self.refill_wait_s is not None and (isinstance(self.refill_wait_s, bool)
                                               or not isinstance(self.refill_wait_s, (int, float))
                                               or not 0 <= self.refill_wait_s <= MAX_REFILL_WAIT_S):
            raise ConfigError(f"refill_wait_s must be a number of seconds within [0, {MAX_REFILL_WAIT_S:g}]")

    def _check_client_only(self) -> None:
        if not isinstance(self.client_only, bool):
            raise ConfigError(f"client_only must be true or false, not {self.client_only!r}")
        if not self.client_only:
            return
        if self.model is None:
            raise ConfigError("--layers none needs --model (its tokenizer and digest; no weights are loaded)")
        if self.layers is not None or self.auto_layers:
            raise ConfigError("--layers none holds no layers: give it instead of --layers A:B or auto")
        if self.memory_bytes is not None:
            raise ConfigError("--layers none holds no layers: --memory does not apply")
        if self.experts is not None or self.offload_experts:
            raise ConfigError("--layers none holds nothing: --experts / offload_experts do not apply")

    def _check_experts(self) -> None:
        if self.expert_act not in EXPERT_ACTS:
            raise ConfigError(f"expert_act must be one of {', '.join(EXPERT_ACTS)}, not {self.expert_act!r}")
        if self.experts is None:
            if self.offload_experts:
                raise ConfigError("offload_experts needs experts (the experts this node holds)")
            return
        if self.model is None:
            raise ConfigError("--experts needs --model (the MoE artifact)")
        if self.auto_layers:
            raise ConfigError("--experts with --layers auto is not supported; give --layers A:B, or run an "
                              "expert peer (--experts without --layers)")
        if self.experts == "auto":
            if self.layers is not None:
                raise ConfigError("--experts auto makes an expert peer: give it without --layers")
            if not (self.memory_bytes and self.memory_bytes > 0):
                raise ConfigError("--experts auto needs --memory SIZE: the experts taken are sized to it")
            return
        from shard.experts.spec import ExpertSpec, ExpertSpecError

        try:
            ExpertSpec.parse(self.experts)
        except ExpertSpecError as exc:
            raise ConfigError(f"experts: {exc}") from exc

    @property
    def has_model(self) -> bool:
        """A model file or directory, or a root to fetch (``--model ROOT``)."""
        return self.model is not None or self.model_root is not None

    @property
    def expert_peer(self) -> bool:
        """This node serves experts without their layers (no --layers)."""
        return self.experts is not None and self.layers is None and not self.auto_layers

    @property
    def role(self) -> str:
        """What this node is in the swarm (``meshd status``): client, shard, auto, expert-peer or dht."""
        if self.client_only:
            return "client"
        if self.auto_layers:
            return "auto"
        if self.layers is not None:
            return "shard"
        return "expert-peer" if self.expert_peer else "dht"

    @property
    def scope(self) -> SwarmScope:
        """The swarm this node belongs to (what its name scopes: dht/host/swarm_scope.py)."""
        return SwarmScope(self.swarm)

    @property
    def control_socket(self) -> Path:
        return self.data_dir / "control.sock"

    @property
    def refill_wait(self) -> float:
        """Seconds the entry waits for a coverage gap to be refilled (see REFILL_SLACK_S)."""
        return float(self.record_ttl_s + REFILL_SLACK_S if self.refill_wait_s is None else self.refill_wait_s)

    @property
    def republish_interval_s(self) -> float:
        """Republish at a third of the TTL: two republishes may fail before expiry."""
        return self.record_ttl_s / 3.0


def machine_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. under taskset or a cgroup)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _check_multiaddr(addr: str) -> None:
    import multiaddr

    try:
        multiaddr.Multiaddr(addr)
    except Exception as exc:  # the multiaddr library raises several unrelated types
        raise ConfigError(f"not a multiaddr: {addr!r} ({exc})") from exc


def parse_layers(text: str) -> tuple[int, int]:
    """``"A:B"`` -> (A, B): the half-open layer range [A, B)."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ConfigError(f"layers must look like A:B (e.g. 0:12), not {text!r}")
    start, end = int(parts[0]), int(parts[1])
    if not start < end:
        raise ConfigError(f"layers {text}: the start must be below the end")
    return start, end


_TOP_KEYS = {f.name for f in fields(DaemonConfig)}
_WORKER_KEYS = {f.name for f in fields(WorkerConfig)}
_API_KEYS = {f.name for f in fields(ApiConfig)}


def read_key_file(path) -> str:
    """The API key in ``path``: its first line, stripped. The file is a secret of this user: a file
    that others may read is refused (chmod 600 it), as ssh refuses a readable private key."""
    path = Path(os.path.expanduser(str(path)))
    try:
        st = path.stat()
        if st.st_size > MAX_API_KEY_FILE_BYTES:
            raise ConfigError(f"the API key file {path} is over {MAX_API_KEY_FILE_BYTES} bytes: not a key file")
        if st.st_mode & 0o077:
            raise ConfigError(f"the API key file {path} may be read by other users (mode {st.st_mode & 0o777:o}): "
                              f"chmod 600 {path}")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ConfigError(f"the API key file {path} does not exist") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the API key file {path}: {exc}") from exc
    lines = text.splitlines()
    key = lines[0].strip() if lines else ""
    if not key:
        raise ConfigError(f"the API key file {path} is empty: its first line is the key")
    return key


def load_config(path: Path | None, overrides: Mapping[str, Any] | None = None) -> DaemonConfig:
    """Build the config from ``path`` (TOML, optional) and ``overrides`` (flags given).

    ``overrides`` maps DaemonConfig field names to values already parsed; None
    values are ignored (the flag was not given). Worker fields use ``worker.NAME``,
    API fields ``api.NAME``. ``MESHD_API_KEY`` in the environment is the key when
    neither the file nor a flag gives one.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {path} does not exist") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    worker_raw = raw.pop("worker", {})
    api_raw = raw.pop("api", {})
    if not isinstance(worker_raw, dict) or not isinstance(api_raw, dict):
        raise ConfigError("[worker] and [api] must be tables")
    if "threads" in worker_raw:   # the short name of worker.torch_threads
        if "torch_threads" in worker_raw:
            raise ConfigError("give [worker] threads or torch_threads, not both")
        worker_raw["torch_threads"] = worker_raw.pop("threads")
    unknown = ((set(raw) - _TOP_KEYS) | {f"worker.{k}" for k in set(worker_raw) - _WORKER_KEYS}
               | {f"api.{k}" for k in set(api_raw) - _API_KEYS})
    if unknown:
        raise ConfigError(f"unknown config keys: {', '.join(sorted(unknown))}")
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key.startswith("worker."):
            worker_raw[key.removeprefix("worker.")] = value
        elif key.startswith("api."):
            api_raw[key.removeprefix("api.")] = value
        else:
            raw[key] = value
    if raw.get("layers") == "auto":
        raw["layers"], raw["auto_layers"] = None, True
    elif raw.get("layers") == "none":
        if raw.get("client_only") is False:
            raise ConfigError('layers = "none" is a client-only node; client_only = false contradicts it')
        raw["layers"], raw["client_only"] = None, True
    for key in ("memory_bytes", "upload_bytes_per_s", "upload_busy_bytes_per_s"):
        if isinstance(raw.get(key), str):
            from meshd.sizes import parse_size

            raw[key] = parse_size(raw[key])
    if isinstance(raw.get("layers"), str):
        raw["layers"] = parse_layers(raw["layers"])
    for key in ("listen", "bootstrap"):
        if key in raw:
            if isinstance(raw[key], str) or not all(isinstance(a, str) for a in raw[key]):
                raise ConfigError(f"{key} must be a list of multiaddr strings")
            raw[key] = tuple(raw[key])
    if "layers" in raw and raw["layers"] is not None:
        raw["layers"] = tuple(raw["layers"])
    if api_raw.get("key_file") is not None:
        if api_raw.get("key") is not None:
            raise ConfigError("give the API key once: api.key_file (--api-key-file) or api.key (--api-key), not both")
        api_raw["key"] = read_key_file(api_raw["key_file"])
        api_raw["key_file"] = str(api_raw["key_file"])
    if api_raw.get("key") is None and os.environ.get("MESHD_API_KEY"):
        api_raw["key"] = os.environ["MESHD_API_KEY"]
    for name in ("allowed_hosts", "cors_origins"):
        if isinstance(api_raw.get(name), list):
            api_raw[name] = tuple(api_raw[name])
    try:
        worker = WorkerConfig(**worker_raw)
        return DaemonConfig(**raw, worker=worker, api=ApiConfig(**api_raw))
    except TypeError as exc:
        raise ConfigError(f"bad config value: {exc}") from exc
