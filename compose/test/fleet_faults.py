"""`make compose-test`: the compose fleet, driven from outside, under the faults a
fleet of hosts meets.

Started by scripts/compose-test.sh, which builds the images, names a unique compose
project, and tears everything down afterwards whatever happens here. This driver:

1. brings the fleet up (compose/docker-compose.yml, 3 gateway containers x 2 workers,
   leases of 3 s, one adoption key shared by every gateway) on a free /24 and a free
   host port for the load balancer;
2. runs the official MCP Python SDK client in legacy mode through nginx:
   counter_increment counts 1, 2, 3, ... while its requests land on every container,
   and slow_stream's progress arrives before its result through a forward;
3. starts a steady load: legacy sessions on every container, each calling
   counter_increment in a loop (raw HTTP, so every status, reason and header is seen);
   their adoption records in the directory hold the upstream's session id sealed;
4. under that load: `docker kill` one gateway container, `docker pause` one past its
   lease, `docker network disconnect` one, and a full certificate rotation. The
   sessions of a container's workers that were proven dead are *adopted* (the demo
   upstream holds their state) and go on: each is told nothing but the transient
   answers of the table while the death is proven, then exactly one answer fleet-wide
   carries `mcpgw-adopted: death`, its counter goes on from where it was, and no ok
   answer after the fault names a dead or fenced worker as its owner; the workers'
   adoption counters agree with the headers;
5. checks that no session was ever served by two owners at once (a new owner only
   where an answer says it adopted the session, never the old one after that) and
   that every session's counter moved by exactly one per request it was told
   succeeded;
6. prints one table: step, requests, answers by class, adoptions, time until the
   victims' sessions were served again.

Requests are classified by what the client got: ok; `unknown` (503,
ownership_unknown / lease_in_doubt: retry the same session); `gone` (404,
session_gone: initialize again); `outcome_unknown` (502: the owner died with the
request); `answer_lost` (502 outcome_unknown with `session_may_continue`: the request
reached an owner that may live, and its answer was lost); `not_found` (404
session_not_found); `lb_error` (nginx's own 502: the gateway process that held the
connection died, the one answer no gateway can give); `timeout`; `transport`; `other`.
While a victim's session waits for adoption, only `unknown`, the two 502
`outcome_unknown` answers (a request in flight at the death) and `lb_error` for a
request in flight at the victim's own edge are allowed; `gone` and `not_found` never
are, since the session can go on.

`--self-test` feeds each check an input that violates it, with no fleet (a second;
scripts/compose-test.sh runs it first).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import random
import socket
import sys
import time
import traceback
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path

import httpx2
import mcp
from mcp.client.streamable_http import streamable_http_client

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose" / "docker-compose.yml"
COMPOSE = os.environ.get("MCPGW_COMPOSE", "docker-compose").split()
# Set by scripts/compose-test.sh; `--self-test` needs no fleet and no project.
PROJECT = os.environ.get("MCPGW_COMPOSE_PROJECT", "")
IMAGE = os.environ.get("MCPGW_IMAGE", "mcpgw:compose-test")

GATEWAYS = ("gw1", "gw2", "gw3")
# The scale-out gateway (compose profile `scale`): joins after the rolling replacement,
# takes new sessions, then is drained and removed.
SCALE_GATEWAY = "gw4"
ALL_GATEWAYS = (*GATEWAYS, SCALE_GATEWAY)
# A diagnostic (MCPGW_TEST_ROLLING_IN_PLACE=1): the rolling replacement without taking
# each container out of nginx first, which measures the gateway's own drain (lame duck,
# queued connections served) behind a balancer that does not follow /readyz.
ROLLING_IN_PLACE = os.environ.get("MCPGW_TEST_ROLLING_IN_PLACE") == "1"
# The `mcpgw-adopted` value of an answer that adopted a session a drained worker
# handed over.
ADOPTED_AFTER_DRAIN = "drain"
# Short leases so that every fault resolves in seconds.
LEASE_S = float(os.environ.get("MCPGW_TEST_LEASE_MS", "3000")) / 1000
SESSIONS_PER_GATEWAY = 5
# Pause between two requests of one load session (about 150 requests/s in all).
THINK_S = 0.1
# A client told "retryable" retries the same session after this long.
RETRY_S = 0.25
# Longer than any fault lasts: a request held by a frozen or cut-off container is
# seen to its real answer instead of being abandoned.
REQUEST_TIMEOUT_S = 60.0
# The longest a worker may take to use rotated certificate files. A watch sees them at
# once and a periodic check within 2 s; this bound only catches a worker that never does.
ROTATE_WAIT_S = float(os.environ.get("MCPGW_TEST_ROTATE_WAIT_S", "30"))
# The gateways' maximum mesh connection age here: short, so the rotation sees
# connections replaced with the new material while the load runs.
MAX_CONNECTION_AGE_S = float(os.environ.get("MCPGW_TEST_MAX_CONNECTION_AGE_MS", "4000")) / 1000
PROTOCOL = "2025-11-25"
JSON_AND_SSE = "application/json, text/event-stream"

# What a victim's session may be told while its owner's death is being proven: retry
# (503), or, for a request in flight at the death, that its outcome is unknown (502).
# Never `gone` or `not_found`: the session is adopted and goes on.
TRANSIENT = ("unknown", "outcome_unknown", "answer_lost")
# The `mcpgw-adopted` value of an answer that adopted a session whose owner died.
ADOPTED_AFTER_DEATH = "death"
CLASSES = ("ok", "unknown", "gone", "outcome_unknown", "answer_lost", "not_found", "lb_error", "timeout",
           "transport", "other")

T0 = time.monotonic()


def now() -> float:
    """Seconds since the driver started."""
    return time.monotonic() - T0


def log(message: str) -> None:
    print(f"[{now():6.1f}s] {message}", flush=True)


class TestFailure(Exception):
    pass


def check(condition: bool, message: str) -> None:
    if not condition:
        raise TestFailure(message)


# --- Docker and compose --------------------------------------------------------------


async def sh(*cmd: str, check_status: bool = True, timeout: float = 300,
             env: dict[str, str] | None = None) -> tuple[int, str]:
    """Runs a command without blocking the load; returns (status, stdout)."""
    process = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})})
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout)
    except asyncio.TimeoutError:
        process.kill()
        raise TestFailure(f"`{' '.join(cmd)}` did not finish in {timeout:.0f} s")
    if check_status and process.returncode != 0:
        raise TestFailure(f"`{' '.join(cmd)}` failed (exit {process.returncode}): "
                          f"{err.decode(errors='replace').strip()[-3000:]}")
    return process.returncode, out.decode(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def free_subnet_prefix() -> str:
    """A 10.211.X.0/24 that no Docker network and no host route overlaps."""
    taken = []
    _, ids = await sh("docker", "network", "ls", "-q")
    if ids.split():
        _, subnets = await sh("docker", "network", "inspect", "-f",
                              "{{range .IPAM.Config}}{{.Subnet}} {{end}}", *ids.split())
        taken += subnets.split()
    _, routes = await sh("ip", "-4", "route", check_status=False)
    taken += [line.split()[0] for line in routes.splitlines() if line and line[0].isdigit()]
    networks = []
    for text in taken:
        try:
            networks.append(ipaddress.ip_network(text, strict=False))
        except ValueError:
            pass
    candidates = list(range(1, 255))
    random.shuffle(candidates)
    for third in candidates:
        subnet = ipaddress.ip_network(f"10.211.{third}.0/24")
        if not any(subnet.overlaps(n) for n in networks if n.version == 4):
            return f"10.211.{third}"
    raise TestFailure("no free 10.211.X.0/24 for the fleet network")


class Fleet:
    """The compose project under test, through the docker CLI (labels, not container
    names, so compose v1 and v2 look the same)."""

    def __init__(self, subnet_prefix: str, lb_port: int):
        self.subnet_prefix = subnet_prefix
        self.lb_port = lb_port
        self.env = {
            "MCPGW_IMAGE": IMAGE,
            "MCPGW_LEASE_MS": str(int(LEASE_S * 1000)),
            "MCPGW_MESH_MAX_CONNECTION_AGE_MS": str(int(MAX_CONNECTION_AGE_S * 1000)),
            # Every request's line at its edge and its owner: a count that moved
            # without an answer is found in the logs where it ran.
            "MCPGW_LOG_REQUESTS": "true",
            "MCPGW_LB_PORT": str(lb_port),
            "MCPGW_LB_BIND": "127.0.0.1",
            "MCPGW_SUBNET_PREFIX": subnet_prefix,
        }
        self.url = f"http://127.0.0.1:{lb_port}/mcp"
        # Compose pins each gateway's address (docker-compose.yml).
        self.ip = {name: f"{subnet_prefix}.{11 + i}" for i, name in enumerate(ALL_GATEWAYS)}

    async def compose(self, *args: str, check_status: bool = True) -> tuple[int, str]:
        return await sh(*COMPOSE, "-p", PROJECT, "-f", str(COMPOSE_FILE), *args,
                        check_status=check_status, env=self.env)

    async def container(self, service: str) -> str:
        _, out = await sh("docker", "ps", "-aq",
                          "--filter", f"label=com.docker.compose.project={PROJECT}",
                          "--filter", f"label=com.docker.compose.service={service}",
                          "--filter", "label=com.docker.compose.oneoff=False")
        ids = out.split()
        check(len(ids) == 1, f"expected one container for {service}, found {ids}")
        return ids[0]

    async def network(self) -> str:
        _, out = await sh("docker", "network", "ls", "-q",
                          "--filter", f"label=com.docker.compose.project={PROJECT}",
                          "--filter", "label=com.docker.compose.network=fleet")
        check(len(out.split()) == 1, f"expected the project's fleet network, found {out.split()}")
        return out.split()[0]

    async def health(self, service: str) -> str:
        _, out = await sh("docker", "inspect", "-f",
                          "{{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}",
                          await self.container(service))
        return out.strip()

    async def wait_healthy(self, service: str, within: float = 90) -> None:
        deadline = time.monotonic() + within
        while (status := await self.health(service)) != "healthy":
            if time.monotonic() > deadline:
                _, logs = await sh("docker", "logs", "--tail", "30", await self.container(service),
                                   check_status=False)
                raise TestFailure(f"{service} is {status} after {within:.0f} s; its log ends:\n{logs}")
            await asyncio.sleep(0.5)

    async def redis(self, *args: str) -> str:
        _, out = await sh("docker", "exec", await self.container("redis"), "redis-cli", "--raw", *args)
        return out

    async def lease_records(self) -> dict[str, dict]:
        """Worker id -> what its live lease publishes (host, admin listener, ...)."""
        keys = (await self.redis("--scan", "--pattern", "mcpgw:worker:*")).split()
        if not keys:
            return {}
        values = (await self.redis("MGET", *keys)).splitlines()
        records = {}
        for key, value in zip(keys, values):
            try:
                record = json.loads(value)
            except ValueError:
                continue  # expired between SCAN and MGET
            if isinstance(record, dict) and "host" in record:
                records[key.removeprefix("mcpgw:worker:")] = record
        return records

    async def leases(self) -> dict[str, str]:
        """Worker id -> container (the host its lease names) for every live lease."""
        return {w: record["host"] for w, record in (await self.lease_records()).items()}

    async def worker_states(self, records: dict[str, dict],
                            with_metrics: bool = False) -> dict[str, dict]:
        """Worker id -> the worker's own `GET /state` (README "Admin listener"), for the
        leased workers in `records`; with `with_metrics`, its `GET /metrics` text too,
        under "metrics". The admin listeners are on each container's loopback, so they
        are read from inside it (bash's /dev/tcp: no curl there); the id is the one the
        worker reports, not the one the lease was found under."""
        ports: dict[str, list[str]] = {}
        for record in records.values():
            if record.get("admin") and record["host"] in ALL_GATEWAYS:
                ports.setdefault(record["host"], []).append(record["admin"].rsplit(":", 1)[-1])
        paths = "/state /metrics" if with_metrics else "/state"
        script = (f'for port in "$@"; do for path in {paths}; do '
                  '(exec 3<>"/dev/tcp/127.0.0.1/$port" && '
                  'printf "GET %s HTTP/1.0\\r\\nHost: 127.0.0.1\\r\\n\\r\\n" "$path" >&3 && cat <&3) 2>/dev/null; '
                  f'echo; echo {PART_END}; done; echo {STATE_END}; done')
        states: dict[str, dict] = {}
        for host, host_ports in sorted(ports.items()):
            _, out = await sh("docker", "exec", await self.container(host), "bash", "-c", script, "_",
                              *host_ports, check_status=False, timeout=30)
            for reply in out.split(STATE_END):
                parts = reply.split(PART_END)
                state = parse_state(parts[0])
                if state is None:
                    continue
                if with_metrics:
                    if len(parts) < 2 or not parts[1].partition("\r\n\r\n")[2].strip():
                        continue
                    state["metrics"] = parts[1].partition("\r\n\r\n")[2]
                states[state["worker_id"]] = state
        return states

    async def adoption_counters(self) -> dict[str, dict[str, int]]:
        """Worker id -> its adoption counters (`adoption_counts`), for every leased
        worker; a worker whose admin listener did not answer is asked again."""
        for _ in range(5):
            records = await self.lease_records()
            states = await self.worker_states(records, with_metrics=True)
            if set(records) <= set(states):
                return {w: adoption_counts(state["metrics"]) for w, state in states.items()}
            await asyncio.sleep(0.5)
        raise TestFailure(f"adoption counters: the workers {sorted(set(records) - set(states))} "
                          f"did not answer GET /metrics on their admin listeners")

    async def lb_members(self, *gateways: str) -> str:
        """Sets the gateways nginx spreads requests over (compose/lb-members.sh: a
        graceful reload); returns once nginx's workers of the old list are gone."""
        _, out = await sh("docker", "exec", await self.container("lb"), "bash",
                          "/usr/local/bin/lb-members", *gateways, timeout=60)
        return out.strip()

    async def wait_ready(self, service: str, workers: int = 2, within: float = 60) -> float:
        """Waits until `service` runs `workers` leased workers, its public /healthz
        answers 200 and every worker's admin /readyz does (what an orchestrator
        waits for before it sends traffic); returns the seconds it took."""
        started = time.monotonic()
        script = ('http-health 8080 /healthz >/dev/null || exit 1; for port in "$@"; do '
                  'http-health "$port" /readyz >/dev/null || exit 1; done')
        status = "no lease yet"
        while time.monotonic() - started < within:
            ports = [r["admin"].rsplit(":", 1)[-1] for r in (await self.lease_records()).values()
                     if r.get("host") == service and r.get("admin")]
            if len(ports) == workers:
                code, _ = await sh("docker", "exec", await self.container(service), "bash", "-c",
                                   script, "_", *ports, check_status=False, timeout=30)
                if code == 0:
                    return time.monotonic() - started
                status = "not ready"
            else:
                status = f"{len(ports)} leased workers"
            await asyncio.sleep(0.2)
        raise TestFailure(f"{service} was not ready within {within:.0f} s ({status})")

    async def logs(self, service: str) -> str:
        """The container's output, stdout and stderr (where the gateways log)."""
        process = await asyncio.create_subprocess_exec(
            "docker", "logs", "-t", await self.container(service),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await process.communicate()
        return out.decode(errors="replace")


# End each worker's replies, and each reply, in the output of `Fleet.worker_states`' script.
STATE_END = "@@mcpgw-state-end@@"
PART_END = "@@mcpgw-reply-end@@"


def parse_state(reply: str) -> dict | None:
    """The JSON body of one HTTP/1.0 answer to `GET /state`, if it is one."""
    _, _, body = reply.partition("\r\n\r\n")
    try:
        state = json.loads(body)
    except ValueError:
        return None
    return state if isinstance(state, dict) and "worker_id" in state else None


class Workers:
    """Which container each worker id belongs to, remembered after the worker is gone
    (a killed worker's id still names the owner of its sessions)."""

    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self.container_of: dict[str, str] = {}

    async def refresh(self) -> dict[str, str]:
        leases = await self.fleet.leases()
        self.container_of.update(leases)
        return leases

    def container(self, worker_id: str | None) -> str | None:
        if worker_id is None:
            return None
        return self.container_of.get(worker_id)

    async def keep_fresh(self) -> None:
        """Replacement workers start during faults; learn their ids as they come."""
        while True:
            try:
                await self.refresh()
            except TestFailure:
                pass  # Redis busy or restarting; next round
            await asyncio.sleep(1)


# --- The load --------------------------------------------------------------------------


@dataclass(eq=False)
class LoadSession:
    sid: str
    # The session's owner now: the worker that opened it, then each worker whose answer
    # said it adopted the session (and that worker's container).
    owner_worker: str
    owner: str
    opened: float
    next_id: int = 2
    ended: bool = False
    answers: list["Answer"] = field(default_factory=list)
    # The worker that opened it, for `check_sessions`, which follows the owners from
    # the answers alone.
    first_owner_worker: str = ""

    def __post_init__(self) -> None:
        self.first_owner_worker = self.first_owner_worker or self.owner_worker


@dataclass
class Answer:
    session: LoadSession | None  # None for an initialize
    sent: float
    done: float
    cls: str
    status: int | None
    reason: str
    edge: str | None  # the container that received the request
    owner_worker: str | None
    value: int | None = None
    message: str = ""  # the error's message, for reports
    adopted: str | None = None  # the `mcpgw-adopted` header: this answer adopted the session
    edge_worker: str | None = None  # the `mcpgw-edge-worker` header: the worker it reached


def parse_jsonrpc(content_type: str, text: str) -> dict | None:
    """The JSON-RPC response in a JSON or SSE body."""
    try:
        if content_type.startswith("text/event-stream"):
            for line in text.splitlines():
                if line.startswith("data:"):
                    message = json.loads(line[5:])
                    if "result" in message or "error" in message:
                        return message
            return None
        message = json.loads(text)
        return message if isinstance(message, dict) else None
    except ValueError:
        return None


class Load:
    """Legacy sessions spread over every container, each calling counter_increment in
    a loop; every answer is recorded."""

    def __init__(self, fleet: Fleet, workers: Workers):
        self.fleet = fleet
        self.workers = workers
        self.client = httpx2.AsyncClient(
            timeout=httpx2.Timeout(REQUEST_TIMEOUT_S, connect=5.0),
            limits=httpx2.Limits(max_connections=200, max_keepalive_connections=100))
        self.answers: list[Answer] = []
        self.inits: list[Answer] = []
        self.sessions: list[LoadSession] = []
        self.tasks: list[asyncio.Task] = []
        self.running = True
        # Set when a load slot dies of an exception: its session's answers would be
        # missing from every step after it, so the run fails at once instead.
        self.crashed = asyncio.Event()

    def edge_of(self, headers: httpx2.Headers) -> str | None:
        """The container that received the request: the last gateway nginx tried (also
        known when nginx answered itself), else the one the edge worker runs on."""
        if headers.get("mcpgw-lb-upstream"):
            address = headers["mcpgw-lb-upstream"].split(",")[-1].strip().rsplit(":", 1)[0]
            edge = next((name for name, ip in self.fleet.ip.items() if ip == address), None)
            if edge is not None:
                return edge
        return self.workers.container(headers.get("mcpgw-edge-worker"))

    async def post(self, body: dict, session: LoadSession | None) -> tuple[Answer, httpx2.Response | None]:
        headers = {"Content-Type": "application/json", "Accept": JSON_AND_SSE}
        if session is not None:
            headers |= {"Mcp-Session-Id": session.sid, "MCP-Protocol-Version": PROTOCOL}
        sent = now()
        try:
            response = await self.client.post(self.fleet.url, json=body, headers=headers)
        except httpx2.TimeoutException:
            return Answer(session, sent, now(), "timeout", None, "", None, None), None
        except httpx2.TransportError as e:
            return Answer(session, sent, now(), "transport", None, type(e).__name__, None, None), None
        done = now()
        message = parse_jsonrpc(response.headers.get("content-type", ""), response.text)
        edge = self.edge_of(response.headers)
        owner = response.headers.get("mcpgw-owner-worker")
        edge_worker = response.headers.get("mcpgw-edge-worker")
        adopted = response.headers.get("mcpgw-adopted")
        status = response.status_code
        if status == 202:  # a notification, accepted
            return Answer(session, sent, done, "ok", status, "", edge, owner), response
        if message is None:
            cls = "lb_error" if status in (502, 504) and "mcpgw-edge-worker" not in response.headers else "other"
            return Answer(session, sent, done, cls, status, response.text[:80].strip(), edge, owner), response
        if status in (200, 202) and "error" not in message:
            value = None
            result = message.get("result") or {}
            if isinstance(result.get("structuredContent"), dict):
                value = result["structuredContent"].get("value")
            return Answer(session, sent, done, "ok", status, "", edge, owner, value,
                          adopted=adopted,
                          edge_worker=edge_worker), response
        error = message.get("error") or {}
        data = error.get("data") or {}
        reason = str(data.get("reason", ""))
        if status == 503 and (reason in ("ownership_unknown", "lease_in_doubt") or data.get("retryable")):
            cls = "unknown"
        elif status in (404, 409) and reason == "session_gone":
            cls = "gone"
        elif status == 404 and reason == "session_not_found":
            cls = "not_found"
        elif status == 502 and reason == "outcome_unknown":
            cls = "answer_lost" if data.get("session_may_continue") else "outcome_unknown"
        else:
            cls = "other"
        return Answer(session, sent, done, cls, status, reason, edge, owner,
                      message=str(error.get("message", "")), adopted=adopted,
                      edge_worker=edge_worker), response

    async def open_session(self) -> LoadSession | None:
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                "params": {"protocolVersion": PROTOCOL, "capabilities": {},
                           "clientInfo": {"name": "mcpgw-compose-test", "version": "0"}}}
        answer, response = await self.post(init, None)
        self.inits.append(answer)
        if answer.cls != "ok" or response is None or "mcp-session-id" not in response.headers:
            return None
        owner_worker = response.headers.get("mcpgw-owner-worker", "")
        owner = self.workers.container(owner_worker)
        if owner is None:
            await self.workers.refresh()
            owner = self.workers.container(owner_worker) or "?"
        session = LoadSession(response.headers["mcp-session-id"], owner_worker, owner, answer.done)
        initialized, _ = await self.post({"jsonrpc": "2.0", "method": "notifications/initialized"}, session)
        if initialized.cls != "ok":
            self.inits.append(initialized)
            return None
        return session

    async def close_session(self, session: LoadSession) -> None:
        try:
            await self.client.delete(self.fleet.url, headers={
                "Mcp-Session-Id": session.sid, "MCP-Protocol-Version": PROTOCOL})
        except httpx2.HTTPError:
            pass

    async def call(self, session: LoadSession) -> Answer:
        body = {"jsonrpc": "2.0", "id": session.next_id, "method": "tools/call",
                "params": {"name": "counter_increment", "arguments": {}}}
        session.next_id += 1
        answer, _ = await self.post(body, session)
        session.answers.append(answer)
        self.answers.append(answer)
        if answer.cls == "ok" and answer.adopted and answer.owner_worker:
            # Its next requests are the adopter's; `live_on` counts it there.
            session.owner_worker = answer.owner_worker
            session.owner = self.workers.container(answer.owner_worker) or "?"
            if session.owner == "?":
                await self.workers.refresh()
                session.owner = self.workers.container(answer.owner_worker) or "?"
        return answer

    async def drive(self, session: LoadSession) -> None:
        """One load slot: a session used until it is gone, then (as the README tells a
        client) a new session in its place. A victim's session told so fails its step."""
        while self.running:
            if session is None:
                session = await self.open_session()
                if session is None:
                    await asyncio.sleep(0.5)
                    continue
            self.sessions.append(session)
            while self.running and not session.ended:
                answer = await self.call(session)
                if answer.cls in ("gone", "not_found"):
                    session.ended = True
                else:
                    await asyncio.sleep(RETRY_S if answer.cls == "unknown" else THINK_S)
            session = None

    def live_on(self, container: str) -> list[LoadSession]:
        return [s for s in self.sessions if s.owner == container and not s.ended]

    async def ensure_spread(self, gateways: tuple[str, ...] = GATEWAYS) -> None:
        """Opens sessions until every gateway container of `gateways` owns
        SESSIONS_PER_GATEWAY live ones; a new session on a container that has enough
        is closed again."""
        for _ in range(20 * len(gateways) * SESSIONS_PER_GATEWAY):
            missing = [g for g in gateways if len(self.live_on(g)) < SESSIONS_PER_GATEWAY]
            if not missing:
                return
            session = await self.open_session()
            if session is None:
                await asyncio.sleep(0.2)
            elif session.owner in missing:
                self.start_slot(session)
                await asyncio.sleep(0)
            else:
                await self.close_session(session)
        counts = {g: len(self.live_on(g)) for g in gateways}
        raise TestFailure(f"could not spread sessions over every container: {counts}")

    def start_slot(self, session: LoadSession) -> None:
        task = asyncio.create_task(self.drive(session))
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or self.crashed.set())
        self.tasks.append(task)

    def crash_report(self) -> str | None:
        """Every crashed load slot's traceback, or None when none crashed."""
        crashed = [t for t in self.tasks if t.done() and not t.cancelled() and t.exception() is not None]
        if not crashed:
            return None
        return f"{len(crashed)} load slots crashed:\n" + "\n".join(
            "".join(traceback.format_exception(t.exception())) for t in crashed)

    def check_running(self) -> None:
        report = self.crash_report()
        check(report is None, report or "")

    async def stop(self) -> None:
        """Ends the load and waits for every slot; a slot's crash is not lost here
        (`check_running` reports it)."""
        self.running = False
        if self.tasks:
            await asyncio.wait(self.tasks)
        await self.client.aclose()


async def unless_load_crashed(load: Load, step: Awaitable["Step"]) -> "Step":
    """Runs a step, failing it the moment a load slot dies of an exception."""
    running = asyncio.ensure_future(step)
    crashed = asyncio.ensure_future(load.crashed.wait())
    try:
        await asyncio.wait({running, crashed}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        crashed.cancel()
    if not running.done():
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
    # A crash is the cause of whatever the step then saw: reported first.
    load.check_running()
    return running.result()


# --- Steps -----------------------------------------------------------------------------


@dataclass
class Step:
    name: str
    answers: list[Answer] = field(default_factory=list)
    # Seconds from the fault until each adopted victim session was served again (its
    # adopting answer arrived), earliest first.
    served_again_s: list[float] = field(default_factory=list)
    # Answers in the step that carry `mcpgw-adopted`, and the victim sessions that
    # needed one each (None: a step without a fault).
    adopted: int = 0
    victims: int | None = None
    others_errors: int = 0
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def counts(self) -> dict[str, int]:
        counts = {c: 0 for c in CLASSES}
        for a in self.answers:
            counts[a.cls] += 1
        return counts


async def wait_until(condition, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise TestFailure(f"{what} did not happen within {within:.0f} s")
        await asyncio.sleep(0.2)


def answers_since(session: LoadSession, since: float) -> list[Answer]:
    return [a for a in session.answers if a.done >= since]


def served_again(session: LoadSession, since: float) -> bool:
    """Whether `session` was adopted since `since` and went on: an ok answer that
    adopted it, then at least one more ok from the same adopter."""
    answers = answers_since(session, since)
    adopting = next((i for i, a in enumerate(answers) if a.adopted), None)
    if adopting is None or answers[adopting].cls != "ok":
        return False
    adopter = answers[adopting].owner_worker
    return any(a.cls == "ok" and a.owner_worker == adopter for a in answers[adopting + 1:])


def describe(sessions: list[LoadSession], since: float, owners: dict[LoadSession, str]) -> str:
    """The last answers of each of `sessions` since `since`, for a failure message."""
    return "; ".join(
        f"{s.sid[:8]}… (owner {owners.get(s, s.first_owner_worker)}): " + " ".join(
            f"{a.cls}{'+adopted' if a.adopted else ''}/{a.reason or a.status}@{a.edge}"
            for a in answers_since(s, since)[-6:])
        for s in sessions[:4])


async def wait_adopted(fault: "Fault", what: str) -> None:
    """Waits until every victim session of `fault` was adopted and served again; fails
    at once when one was told it is gone (it could never be), and says what the ones
    still waiting were answered when that does not happen in time."""
    deadline = time.monotonic() + LEASE_S * 5 + 20
    while True:
        ended = [s for s in fault.victims if s.ended]
        check(not ended, f"{what}: {len(ended)} victim sessions were told they are gone: "
              + describe(ended, fault.issued, fault.owners))
        waiting = [s for s in fault.victims if not served_again(s, fault.issued)]
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise TestFailure(f"{what} did not happen within {LEASE_S * 5 + 20:.0f} s; "
                              f"{len(waiting)} still waiting: "
                              + describe(waiting, fault.issued, fault.owners))
        await asyncio.sleep(0.2)


def window(load: Load, start: float, end: float) -> list[Answer]:
    return [a for a in load.answers if start <= a.sent < end]


@dataclass
class Fault:
    """When a fault was made: `issued` just before the docker command, `effective`
    when it returned. A request sent after `effective` cannot have been served by the
    victim; answers are timed from `issued` (the conservative side). `owners`: each
    victim session's owner when the fault was made (a session's owner changes when it
    is adopted)."""
    victim: str
    victims: list[LoadSession]
    owners: dict[LoadSession, str]
    issued: float
    effective: float


def summary(answers: list[Answer]) -> str:
    return ", ".join(f"{c}={sum(1 for a in answers if a.cls == c)}"
                     for c in CLASSES if any(a.cls == c for a in answers))


def victim_problems(answers: list[Answer], victim: str, old_owner: str, effective: float,
                    dead: set[str], adopted_once: bool = True) -> list[str]:
    """What is wrong with the answers to one victim session after its fault
    (`answers`, in order; its owner was `old_owner`, and `dead` are the workers proven
    dead). Until the answer that adopted it, only: an ok sent before the fault took
    effect (from the old owner), the transient answers while the death is proven, and
    nginx's own 502 for a request in flight at the victim's own edge (the one answer no
    gateway can give). The adopting answer: ok, `mcpgw-adopted: death`, from a worker
    that is not dead. After it: ok from the adopter only (never the old owner, never
    another dead worker); a retryable 503 from an edge that has not learnt of the
    death yet (it tried the old owner, whom the session id still names); a transient
    answer at the victim's own edge. Never `gone` or
    `not_found`: the session can go on. Exactly one adopting answer fleet-wide; while
    the fault lasts (`adopted_once` false) at most one."""
    problems = []
    adoptions = [a for a in answers if a.adopted]
    if len(adoptions) > 1 or (adopted_once and not adoptions):
        problems.append(f"{len(adoptions)} answers carry mcpgw-adopted, not 1")
    adopter: str | None = None
    for a in answers:
        seen = (f"{a.cls} {a.status or ''} {a.reason} at {a.sent:.1f}s via {a.edge} "
                f"from {a.owner_worker}")
        if a.cls in ("gone", "not_found"):
            problems.append(f"told {seen}: {a.message[:120]}")
        elif a.adopted and adopter is None:
            if (a.cls != "ok" or a.adopted != ADOPTED_AFTER_DEATH or not a.owner_worker
                    or a.owner_worker == old_owner or a.owner_worker in dead):
                problems.append(f"adopted by {seen} (mcpgw-adopted: {a.adopted})")
            adopter = a.owner_worker
        elif adopter is None:
            if not (a.cls in TRANSIENT or (a.cls == "lb_error" and a.edge == victim)
                    or (a.cls == "ok" and a.sent < effective and a.owner_worker == old_owner)):
                problems.append(f"before its adoption, {seen}")
        elif a.cls == "ok":
            if a.owner_worker != adopter:
                problems.append(f"after its adoption by {adopter}, served by {seen}")
        elif not (a.cls == "unknown"
                  or (a.edge == victim and (a.cls in TRANSIENT or a.cls == "lb_error"))):
            problems.append(f"after its adoption, {seen}")
    return problems


def judge_fault(step: Step, load: Load, fault: Fault, start: float, end: float, dead: set[str],
                resumed: set[str] = frozenset(), held_until: float | None = None) -> None:
    """What every fault step must show: each session of the victim container's
    workers that were proven dead (`dead`) was adopted once and went on, told only
    what `victim_problems` allows; the sessions of a worker that nobody declared dead
    (`resumed`: it kept its lease, so serving its sessions again is right) were served
    by it again and never adopted; no ok answer after the fault names a dead worker as
    owner; every other session saw no error through any other container, and none was
    adopted."""
    victim = fault.victim
    victims = [s for s in fault.victims if fault.owners[s] not in resumed]
    kept = [s for s in fault.victims if fault.owners[s] in resumed]
    step.answers = window(load, start, end)
    step.victims = len(victims)
    problems = [f"{s.sid[:8]}… of {fault.owners[s]}: {problem}" for s in victims
                for problem in victim_problems(answers_since(s, fault.issued), victim,
                                               fault.owners[s], fault.effective, dead)]
    check(not problems, f"{step.name}: {len(problems)} problems with the victim's sessions: "
          + "; ".join(problems[:6]))
    adoptions = [a for s in victims for a in answers_since(s, fault.issued) if a.adopted]
    step.adopted = len(adoptions)
    step.served_again_s = sorted(a.done - fault.issued for a in adoptions)
    dead_served = [a for a in step.answers
                   if a.cls == "ok" and a.sent >= fault.effective and a.owner_worker in dead]
    check(not dead_served, f"{step.name}: {len(dead_served)} ok answers after the fault name a "
          f"dead worker as owner: {[(a.owner_worker, a.edge, round(a.sent, 1)) for a in dead_served[:5]]}")
    if kept:
        # Told "gone" (or "outcome unknown"), or taken by another worker, and then served
        # by its own owner again would be two owners, or a lie.
        contradicted = [a for s in kept for a in answers_since(s, fault.issued)
                        if a.cls in ("gone", "not_found", "outcome_unknown") or a.adopted
                        or (a.cls == "ok" and a.owner_worker != fault.owners[s])]
        check(not contradicted, f"{step.name}: sessions of a worker that resumed its lease were "
              f"told {[(a.cls, a.owner_worker, a.adopted, a.message) for a in contradicted[:3]]}")
        step.notes.append(f"{len(kept)} of its sessions belonged to {sorted(resumed)}, which nobody "
                          f"declared dead (their requests were waiting at {victim} itself): it "
                          f"resumed its lease and serves them again, as designed")
    victim_set = set(fault.victims)
    others = [a for a in step.answers if a.session not in victim_set]
    adopted_others = [a for a in others if a.adopted]
    check(not adopted_others, f"{step.name}: sessions whose owner lives were adopted: "
          f"{[(a.session.sid[:8] if a.session else None, a.owner_worker, a.adopted) for a in adopted_others[:5]]}")
    at_victim_edge = [a for a in others if a.cls != "ok" and a.edge == victim]
    elsewhere = [a for a in others if a.cls != "ok" and a.edge != victim]
    step.others_errors = len(elsewhere)
    check(not elsewhere, f"{step.name}: sessions on other containers got errors through the "
          f"surviving containers: {[(a.cls, a.status, a.reason, a.edge, a.message) for a in elsewhere[:5]]}")
    if at_victim_edge:
        step.notes.append(f"{len(at_victim_edge)} requests of other sessions were in flight at "
                          f"{victim}'s own edge ({summary(at_victim_edge)}): nginx cannot replay "
                          f"a POST that may have executed")
    if held_until is not None:
        held = [a for a in step.answers if a.edge == victim and fault.issued <= a.sent < held_until]
        if held:
            step.notes.append(f"{len(held)} requests reached {victim} during the fault and "
                              f"waited for it: {summary(held)}")
    adopters = sorted({load.workers.container(a.owner_worker) or str(a.owner_worker) for a in adoptions})
    retried = [b for s in victims for a in answers_since(s, fault.issued) if a.adopted
               for b in answers_since(s, a.done) if b.cls == "unknown" and b.edge != victim]
    if retried:
        step.notes.append(f"{len(retried)} retryable 503s after an adoption, from edges that had "
                          f"not learnt of the death yet: {summary(retried)}")
    if victims:
        step.notes.append(
            f"{len(victims)} sessions of {sorted(dead)} adopted once each, by workers on "
            f"{', '.join(adopters)}; served again {step.served_again_s[0]:.1f}-"
            f"{step.served_again_s[-1]:.1f} s after the fault, counters going on")
    step.notes.append(f"its {len(fault.victims)} sessions, answers after the fault: " + "; ".join(
        " ".join(f"{a.cls}{'+adopted' if a.adopted else ''}@{a.done - fault.issued:.1f}s"
                 + (f"[{a.edge}]" if a.edge == victim else "")
                 for a in answers_since(s, fault.issued))[:160] for s in fault.victims))
    failed_inits = [a for a in load.inits if start <= a.sent < end and a.cls != "ok"]
    if failed_inits:
        step.notes.append(f"{len(failed_inits)} initialize attempts were refused or lost and "
                          f"retried: " + "; ".join(sorted({f"{a.cls} {a.status or ''} {a.reason} "
                                                           f"{a.message[:70]}".strip()
                                                           for a in failed_inits})))


# `mcpgw_sessions_adopted_total{cause=...}` and `mcpgw_adoptions_refused_total{why=...}`
# of one worker's /metrics, as {"death": n, "drain": n, "refused": n}.
def adoption_counts(metrics_text: str) -> dict[str, int]:
    counts = {"death": 0, "drain": 0, "refused": 0}
    for line in metrics_text.splitlines():
        name, _, rest = line.partition("{")
        labels, _, value = rest.partition("} ")
        try:
            number = int(float(value.split()[0])) if value else 0
        except ValueError:
            continue
        if name == "mcpgw_sessions_adopted_total":
            cause = labels.removeprefix('cause="').removesuffix('"')
            if cause in counts:
                counts[cause] += number
        elif name == "mcpgw_adoptions_refused_total":
            counts["refused"] += number
    return counts


def adoption_count_problems(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]],
                            adopted_answers: int, cause: str = "death") -> list[str]:
    """What the workers' adoption counters (worker id -> `adoption_counts`, before and
    after a step) say against the answers: the adoptions of `cause` (a death, or a
    drain) counted fleet-wide must be exactly the answers that carried
    `mcpgw-adopted`, with none of the other cause and no refused one (every session
    here has an HTTP upstream and every gateway the same key). A worker gone by the
    end (fenced, drained) must not have adopted."""
    def moved(kind: str) -> int:
        return sum(after[w][kind] - before.get(w, {}).get(kind, 0) for w in after)

    other = "drain" if cause == "death" else "death"
    problems = []
    if moved(cause) != adopted_answers:
        problems.append(f"the workers counted {moved(cause)} adoptions after a {cause}, the "
                        f"answers carried mcpgw-adopted {adopted_answers} times")
    if moved(other):
        problems.append(f"{moved(other)} adoptions after a {other} counted; no {other} here")
    if moved("refused"):
        problems.append(f"{moved('refused')} adoptions refused (mcpgw_adoptions_refused_total)")
    return problems


async def check_adoption_counters(step: Step, fleet: Fleet, before: dict[str, dict[str, int]],
                                  cause: str = "death") -> None:
    after = await fleet.adoption_counters()
    problems = adoption_count_problems(before, after, step.adopted, cause)
    check(not problems, f"{step.name}: adoption metrics: " + "; ".join(problems))
    step.notes.append(f"mcpgw_sessions_adopted_total{{cause=\"{cause}\"}} rose by {step.adopted} "
                      f"over the fleet's {len(after)} workers; no adoption refused")


async def settle(workers: Workers, fault: Fault, since: float) -> tuple[set[str], set[str]]:
    """Waits until each of the victim's sessions is settled: adopted since the fault and
    served again, or served again after `since` by its own owner, which nobody declared
    dead meanwhile (it resumed its lease). Fails at once when one was told it is gone.
    Returns (resumed owners, owners declared dead): an owner with an adopted session
    was declared dead, whatever its lease says at this moment."""
    deadline = time.monotonic() + LEASE_S * 5 + 20
    while True:
        live = await workers.refresh()

        def settled(s: LoadSession) -> bool:
            return served_again(s, fault.issued) or (fault.owners[s] in live and any(
                a.cls == "ok" and a.sent >= since and a.owner_worker == fault.owners[s]
                for a in s.answers))

        ended = [s for s in fault.victims if s.ended]
        check(not ended, f"{fault.victim}'s sessions: {len(ended)} were told they are gone: "
              + describe(ended, fault.issued, fault.owners))
        if all(settled(s) for s in fault.victims):
            break
        if time.monotonic() > deadline:
            open_ones = [s for s in fault.victims if not settled(s)]
            raise TestFailure(f"{fault.victim}'s sessions did not settle (adopted and served "
                              f"again, or served by a resumed owner): " + "; ".join(
                                  f"{s.sid[:8]}… (owner {fault.owners[s]}, lease "
                                  f"{'live' if fault.owners[s] in live else 'gone'}): " + " ".join(
                                      f"{a.cls}{'+adopted' if a.adopted else ''}/"
                                      f"{a.reason or a.status}@{a.edge}" for a in s.answers[-6:])
                                  for s in open_ones[:4]))
        await asyncio.sleep(0.5)
    owners = set(fault.owners.values())
    adopted_from = {fault.owners[s] for s in fault.victims if served_again(s, fault.issued)}
    resumed = (owners & set(live)) - adopted_from
    return resumed, owners - resumed


# What a worker logs when it finds that it was declared dead and fences itself
# (`Worker::fence`, gateway/src/worker.rs), with its own id as the `worker` field. The
# words "declared dead" alone are also in other lines (the lease check's, and request
# details naming another worker), and `worker=` is in most lines a worker logs.
FENCE_LINE = "fenced: declared dead by the fleet"
# What a worker logs at start when it has no adoption key (gateway/src/serve.rs): the
# compose fleet gives every gateway one, so no gateway may log it.
CLEAR_RECORDS_LINE = "adoption records hold upstream session ids in the clear"


def fenced_workers(log_text: str, dead: set[str]) -> set[str]:
    """The workers of `dead` that logged their own fencing line."""
    fenced = set()
    for line in log_text.splitlines():
        if FENCE_LINE in line:
            fenced |= {token.removeprefix("worker=").strip('"') for token in line.split()
                       if token.startswith("worker=")}
    return fenced & dead


async def rejoined(fleet: Fleet, workers: Workers, victim: str, dead: set[str]) -> set[str]:
    """Waits until the victim's workers that were declared dead have fenced themselves
    (each logs it) and the container runs a full set of workers again; returns the ids
    it runs now that it did not run before."""
    deadline = time.monotonic() + 30
    while True:
        leases = await workers.refresh()
        mine = {w for w, host in leases.items() if host == victim}
        logs = await fleet.logs(victim)
        fenced = fenced_workers(logs, dead)
        if fenced == dead and not (mine & dead) and len(mine) >= 2:
            return mine
        if time.monotonic() > deadline:
            raise TestFailure(f"{victim} did not fence and rejoin within 30 s: declared dead "
                              f"{sorted(dead)}, logged fencing {sorted(fenced)}, leases now {sorted(mine)}")
        await asyncio.sleep(0.5)


def record_problems(records: list[str]) -> tuple[list[str], set[str]]:
    """What is wrong with the adoption records (`session_state:<sid>` values,
    `<state>|<kind>|<guard>|<payload>`) of live sessions: each must exist and hold the
    upstream's session id sealed (`sealed:<key id>:...`), never in the clear, since the
    fleet has an adoption key. Returns the problems and the key ids that sealed them."""
    problems, key_ids = [], set()
    for number, value in enumerate(records):
        parts = value.split("|", 3)
        try:
            payload = json.loads(parts[3]) if len(parts) == 4 else None
        except ValueError:
            payload = None
        if not isinstance(payload, dict):
            problems.append(f"record {number}: missing or unreadable ({value[:40]!r})")
            continue
        upstream_session = str(payload.get("upstream_session"))
        if not upstream_session.startswith("sealed:"):
            problems.append(f"record {number}: the upstream session id is not sealed "
                            f"({upstream_session.split(':', 1)[0]}:…)")
        else:
            key_ids.add(upstream_session.split(":")[1])
    return problems, key_ids


async def steady_step(fleet: Fleet, load: Load, seconds: float = 5) -> Step:
    step = Step("steady load, 3 containers")
    await load.ensure_spread()
    start = now()
    await asyncio.sleep(seconds)
    step.answers = window(load, start, now())
    bad = [a for a in step.answers if a.cls != "ok"]
    step.others_errors = len(bad)
    check(not bad, f"steady load: errors {[(a.cls, a.status, a.reason, a.edge) for a in bad[:5]]}")
    adopted = [a for a in step.answers if a.adopted]
    check(not adopted, f"steady load: {len(adopted)} answers say they adopted a live session")
    edges = {a.edge for a in step.answers}
    check(set(GATEWAYS) <= edges, f"steady load reached only {edges}")
    forwarded = sum(1 for a in step.answers if a.session and a.owner_worker
                    and a.edge != a.session.owner)
    step.notes.append(f"{forwarded} of {len(step.answers)} requests crossed containers")
    # The adoption key reached every gateway (compose's MCPGW_ADOPTION_KEY_FILE): the
    # records another worker adopts from hold the upstream's session id sealed with it.
    live = [s for s in load.sessions if not s.ended]
    records = (await fleet.redis("MGET", *[f"mcpgw:session_state:{s.sid}" for s in live])).splitlines()
    problems, key_ids = record_problems(records[:len(live)] + [""] * (len(live) - len(records)))
    check(not problems, f"steady load: adoption records: {'; '.join(problems[:5])}")
    check(len(key_ids) == 1, f"steady load: the records were sealed with {len(key_ids)} keys, not 1")
    for gateway in GATEWAYS:
        check(CLEAR_RECORDS_LINE not in await fleet.logs(gateway),
              f"steady load: {gateway} logged that it records upstream session ids in the clear")
    step.notes.append(f"the adoption records of all {len(live)} sessions hold the upstream's "
                      f"session id sealed, with key {key_ids.pop()}")
    return step


async def kill_step(fleet: Fleet, load: Load, workers: Workers, victim: str) -> Step:
    step = Step(f"docker kill {victim}")
    await load.ensure_spread()
    await asyncio.sleep(1)
    start = now()
    victims = load.live_on(victim)
    owners = {s: s.owner_worker for s in victims}
    dead = {w for w, host in (await workers.refresh()).items() if host == victim}
    counted = await fleet.adoption_counters()
    container = await fleet.container(victim)
    issued = now()
    await sh("docker", "kill", container)
    fault = Fault(victim, victims, owners, issued, now())
    log(f"killed {victim} ({len(victims)} sessions on it)")
    await wait_adopted(fault, f"every session of killed {victim} adopted and served again")
    await asyncio.sleep(1)
    judge_fault(step, load, fault, start, now(), dead)
    await check_adoption_counters(step, fleet, counted)
    await sh("docker", "start", container)
    await fleet.wait_healthy(victim)
    log(f"{victim} started again")
    return step


def must_pause_again(step_name: str, victim: str, attempt: int, dead: set[str],
                     while_frozen: list[Answer]) -> bool:
    """Whether the pause showed nothing to judge and is made once more: when no
    session of the victim reached another container while it was frozen, or nobody
    declared a worker of it dead, fencing was not exercised. A second such pause fails."""
    if dead and while_frozen:
        return False
    check(attempt == 1, f"{step_name}: twice, no worker of {victim} was declared dead while frozen")
    return True


async def pause_step(fleet: Fleet, load: Load, workers: Workers, victim: str,
                     attempt: int = 1) -> Step:
    step = Step(f"docker pause {victim} {2 * LEASE_S + 1:.0f} s")
    await load.ensure_spread()
    await asyncio.sleep(1)
    start = now()
    victims = load.live_on(victim)
    owners = {s: s.owner_worker for s in victims}
    before = {w for w, host in (await workers.refresh()).items() if host == victim}
    counted = await fleet.adoption_counters()
    container = await fleet.container(victim)
    for freeze_try in range(1, 6):
        issued = now()
        try:
            await sh("docker", "pause", container)
            break
        except TestFailure as e:
            # The cgroup v1 freezer gives up when a process forks while it freezes;
            # runc thaws the container again, and a second try finds it quiet.
            if "unable to freeze" not in str(e) or freeze_try == 5:
                raise
            log(f"docker pause {victim}: the freezer gave up (try {freeze_try}); trying again")
            await asyncio.sleep(0.5)
    fault = Fault(victim, victims, owners, issued, now())
    log(f"paused {victim} ({len(victims)} sessions on it)")
    await asyncio.sleep(2 * LEASE_S + 1)
    # While it is frozen, its sessions are answered by the other containers only: the
    # transient answers, then (once a frozen owner's lease has expired) by the worker
    # that adopted them; none of the frozen workers serves anything.
    while_frozen = [a for s in victims for a in s.answers if a.sent >= fault.effective]
    problems = [f"{s.sid[:8]}…: {problem}" for s in victims
                for problem in victim_problems(answers_since(s, fault.issued), victim, owners[s],
                                               fault.effective, before, adopted_once=False)]
    check(not problems, f"{step.name}: answers while frozen: " + "; ".join(problems[:5]))
    adopted_frozen = sum(1 for a in while_frozen if a.adopted)
    await sh("docker", "unpause", container)
    woke = now()
    log(f"unpaused {victim}")
    resumed, dead = await settle(workers, fault, woke)
    # Every session of it may have had its request waiting at the frozen container
    # itself, so that no other worker had reason to declare it dead: it rightly
    # resumed, and fencing was not exercised. Then it is frozen once more.
    if must_pause_again(step.name, victim, attempt, dead, while_frozen):
        log(f"no session of {victim} reached another container while it was frozen; pausing it again")
        await fleet.wait_healthy(victim)
        return await pause_step(fleet, load, workers, victim, attempt + 1)
    now_running = await rejoined(fleet, workers, victim, dead)
    step.notes.append(f"{len(while_frozen)} answers to its sessions while frozen, {adopted_frozen} "
                      f"of them adopting one; on waking, {sorted(dead)} found themselves declared "
                      f"dead and fenced; {victim} now runs {sorted(now_running - before)} (new) "
                      f"{sorted(now_running & before)} (resumed)")
    await asyncio.sleep(1)
    judge_fault(step, load, fault, start, now(), dead, resumed=resumed, held_until=woke)
    await check_adoption_counters(step, fleet, counted)
    await fleet.wait_healthy(victim)
    return step


async def disconnect_step(fleet: Fleet, load: Load, workers: Workers, victim: str) -> Step:
    step = Step(f"network disconnect {victim}")
    await load.ensure_spread()
    await asyncio.sleep(1)
    start = now()
    victims = load.live_on(victim)
    owners = {s: s.owner_worker for s in victims}
    before = {w for w, host in (await workers.refresh()).items() if host == victim}
    counted = await fleet.adoption_counters()
    container = await fleet.container(victim)
    network = await fleet.network()
    issued = now()
    await sh("docker", "network", "disconnect", network, container)
    fault = Fault(victim, victims, owners, issued, now())
    log(f"cut {victim} off the network ({len(victims)} sessions on it)")
    # Cut off, it can answer nobody: every session of it is adopted by the others once
    # its owner's lease has expired.
    await asyncio.sleep(2 * LEASE_S + 1)
    await sh("docker", "network", "connect", "--ip", fleet.ip[victim], "--alias", victim,
             network, container)
    back = now()
    log(f"reconnected {victim}")
    resumed, dead = await settle(workers, fault, back)
    check(dead, f"{step.name}: no worker of {victim} was declared dead while cut off")
    now_running = await rejoined(fleet, workers, victim, dead)
    new = now_running - before
    check(new, f"{step.name}: {victim} did not rejoin under a new id")
    step.notes.append(f"declared dead while cut off: {sorted(dead)}; after reconnecting it "
                      f"rejoined under new ids {sorted(new)}"
                      + (f", kept {sorted(now_running & before)}" if now_running & before else ""))
    await asyncio.sleep(1)
    judge_fault(step, load, fault, start, now(), dead, resumed=resumed, held_until=back)
    await check_adoption_counters(step, fleet, counted)
    await fleet.wait_healthy(victim)
    return step


ROTATION_STAGES = ("begin", "reissue", "finish")


def rotation_problems(stage: str, alive: set[str], at_start: dict[str, dict],
                      before: dict[str, dict], after: dict[str, dict]) -> list[str]:
    """What is wrong with the workers' reports (their `/state`) once a rotation stage's
    files have landed, one line per worker that is not done yet. Every worker that was
    alive when the stage began must have reloaded since (`reloads` counts every file
    change it took), and must now use the stage's material: `begin` adds the new CA to
    the bundle, `reissue` gives it a leaf from the new CA, `finish` leaves only the new
    CA. `at_start` is each worker's report before the rotation, `before` before this stage."""
    problems = []
    for w in sorted(alive):
        if w not in after or w not in before or w not in at_start:
            problems.append(f"{w}: no /state (before the rotation: {w in at_start}, before {stage}: "
                            f"{w in before}, after: {w in after})")
            continue
        old, was, now_ = (at_start[w]["mesh_cert"], before[w]["mesh_cert"], after[w]["mesh_cert"])
        old_cas, cas = set(old["ca_fingerprints"]), set(now_["ca_fingerprints"])
        if now_["reloads"] <= was["reloads"]:
            problems.append(f"{w}: no reload since {stage} began (reloads {now_['reloads']})")
            continue
        if stage == "begin":
            took = cas > old_cas
        elif stage == "reissue":
            took = cas > old_cas and now_["leaf_fingerprint"] != old["leaf_fingerprint"]
        else:
            took = len(cas) == 1 and not cas & old_cas and now_["leaf_fingerprint"] != old["leaf_fingerprint"]
        if not took:
            problems.append(f"{w}: reloaded, but does not use the material of {stage}: "
                            f"{len(cas)} CAs ({len(cas & old_cas)} old), leaf "
                            f"{'new' if now_['leaf_fingerprint'] != old['leaf_fingerprint'] else 'old'}")
    return problems


async def rotation_step(fleet: Fleet, load: Load) -> Step:
    step = Step("certificate rotation")
    try:
        await sh("docker", "run", "--rm", "--entrypoint", "mcpgw", IMAGE, "certs", "rotate", "--help")
    except TestFailure as e:
        raise TestFailure(f"rotation: `mcpgw certs rotate` is not available in {IMAGE}: {e}")
    await load.ensure_spread()
    start = now()
    live = [s for s in load.sessions if not s.ended]
    records = await fleet.lease_records()
    hosts = sorted(record["host"] for record in records.values())
    check(hosts == sorted(GATEWAYS * 2), f"rotation: expected 2 workers on each of {GATEWAYS}, "
          f"the directory has {hosts}")
    at_start = await fleet.worker_states(records)
    for stage in ROTATION_STAGES:
        records = await fleet.lease_records()
        alive = set(records)
        before = await fleet.worker_states(records)
        _, out = await fleet.compose("run", "--rm", "--no-deps", "-T", "certs", "rotate", stage)
        landed = now()
        log(f"certs rotate {stage}: {out.strip().splitlines()[-1] if out.strip() else 'done'}")
        # Each worker follows its files (a watch, a periodic check as the fallback); the
        # bound only catches a worker that never takes them.
        deadline = time.monotonic() + ROTATE_WAIT_S
        while problems := rotation_problems(stage, alive, at_start, before,
                                            await fleet.worker_states(await fleet.lease_records())):
            check(time.monotonic() < deadline, f"rotation: after {stage}, {len(problems)} workers "
                  f"did not take the new files within {ROTATE_WAIT_S:.0f} s: " + "; ".join(problems))
            await asyncio.sleep(0.5)
        step.notes.append(f"{stage}: all {len(alive)} workers reloaded and use its material "
                          f"{now() - landed:.1f} s after its files landed")
        # Connections made with the old material are replaced within the maximum age,
        # and must not fail a request meanwhile: the load runs through that age.
        await asyncio.sleep(max(0.0, landed + MAX_CONNECTION_AGE_S * 1.5 - now()))
    _, status_out = await fleet.compose("run", "--rm", "--no-deps", "-T", "certs", "rotate", "status",
                                        check_status=False)
    step.notes.append(f"rotate status: {' '.join(status_out.split())[:200]}")
    step.answers = window(load, start, now())
    bad = [a for a in step.answers if a.cls != "ok"]
    step.others_errors = len(bad)
    check(not bad, f"rotation: failed requests {[(a.cls, a.status, a.reason, a.edge) for a in bad[:5]]}")
    step.adopted = sum(1 for a in step.answers if a.adopted)
    check(not step.adopted, f"rotation: {step.adopted} answers say they adopted a live session")
    check(not any(s.ended for s in live), "rotation: a session was lost")
    return step


# --- Rolling replacement, scale out, scale in --------------------------------------------


def drained_problems(answers: list[Answer], drained: set[str], old_owner: str) -> list[str]:
    """What is wrong with the answers to one session of a drained container after the
    drain began (`answers`, in order; its owner was `old_owner`, one of the `drained`
    workers). A drain fails no request: every answer is ok. Until the answer that
    adopted it, the old owner serves it (a drain lets what reached it finish); exactly
    one answer carries `mcpgw-adopted: drain`, from a worker that was not drained; after
    it, the adopter alone serves it."""
    problems = []
    adoptions = [a for a in answers if a.adopted]
    if len(adoptions) != 1:
        problems.append(f"{len(adoptions)} answers carry mcpgw-adopted, not 1")
    adopter: str | None = None
    for a in answers:
        seen = (f"{a.cls} {a.status or ''} {a.reason} at {a.sent:.1f}s via {a.edge} "
                f"from {a.owner_worker}")
        if a.cls != "ok":
            problems.append(f"told {seen}: {a.message[:120]}")
        elif a.adopted and adopter is None:
            if a.adopted != ADOPTED_AFTER_DRAIN or not a.owner_worker or a.owner_worker in drained:
                problems.append(f"adopted by {seen} (mcpgw-adopted: {a.adopted})")
            adopter = a.owner_worker
        elif adopter is None:
            if a.owner_worker != old_owner:
                problems.append(f"before its adoption, served by {seen}")
        elif a.owner_worker != adopter:
            problems.append(f"after its adoption by {adopter}, served by {seen}")
    return problems


def failed_requests(answers: list[Answer], inits: list[Answer]) -> list[Answer]:
    """Every request of a step that did not succeed: calls and initializes alike (a
    step that must fail no request counts a refused initialize too)."""
    return [a for a in answers + inits if a.cls != "ok"]


def judge_drain(step: Step, load: Load, fault: Fault, start: float, end: float,
                drained: set[str], out_until: float) -> None:
    """What a drain step must show (a container taken out of nginx, then stopped with
    SIGTERM): no request of the step failed, calls and initializes alike; each session
    the drained workers held was adopted once after the drain (`mcpgw-adopted: drain`)
    and went on (`drained_problems`); no other session was adopted; no answer sent
    after the container stopped names a drained worker as owner; no request reached
    the container from the drain's start until it was put back (`out_until`)."""
    step.answers = window(load, start, end)
    inits = [a for a in load.inits if start <= a.sent < end]
    failed = failed_requests(step.answers, inits)
    step.others_errors = len(failed)
    check(not failed, f"{step.name}: {len(failed)} requests failed: "
          + "; ".join(f"{a.cls} {a.status} {a.reason} via {a.edge} at {a.sent:.1f}s: {a.message[:80]}"
                      for a in failed[:6]))
    step.victims = len(fault.victims)
    problems = [f"{s.sid[:8]}… of {fault.owners[s]}: {problem}" for s in fault.victims
                for problem in drained_problems(answers_since(s, fault.issued), drained,
                                                fault.owners[s])]
    check(not problems, f"{step.name}: {len(problems)} problems with the drained sessions: "
          + "; ".join(problems[:6]))
    adoptions = [a for s in fault.victims for a in answers_since(s, fault.issued) if a.adopted]
    step.adopted = len(adoptions)
    step.served_again_s = sorted(a.done - fault.issued for a in adoptions)
    victim_set = set(fault.victims)
    others_adopted = [a for a in step.answers if a.adopted and a.session not in victim_set]
    check(not others_adopted, f"{step.name}: sessions of gateways that were not drained were "
          f"adopted: {[(a.session.sid[:8] if a.session else None, a.owner_worker, a.adopted) for a in others_adopted[:5]]}")
    late = [a for a in step.answers if a.sent >= fault.effective and a.owner_worker in drained]
    check(not late, f"{step.name}: {len(late)} answers after the drained container stopped name "
          f"a drained worker as owner: {[(a.owner_worker, a.edge, round(a.sent, 1)) for a in late[:5]]}")
    at_drained_edge = [a for a in step.answers
                       if fault.issued <= a.sent < out_until and a.edge == fault.victim]
    check(not at_drained_edge, f"{step.name}: {len(at_drained_edge)} requests reached "
          f"{fault.victim} after nginx was told to leave it out")
    if fault.victims:
        adopters = sorted({load.workers.container(a.owner_worker) or str(a.owner_worker)
                           for a in adoptions})
        step.notes.append(f"{len(fault.victims)} sessions of {sorted(drained)} handed over and "
                          f"adopted once each (mcpgw-adopted: drain) by workers on "
                          f"{', '.join(adopters)}, {step.served_again_s[0]:.1f}-"
                          f"{step.served_again_s[-1]:.1f} s after SIGTERM, counters going on")
    step.notes.append(f"{len(step.answers)} calls and {len(inits)} initializes, none failed")


async def drain_container(fleet: Fleet, load: Load, workers: Workers, victim: str,
                          serving: tuple[str, ...], step: Step,
                          take_out: bool = True) -> tuple[Fault, set[str]]:
    """Takes `victim` out of nginx (which then spreads over `serving`), stops it with
    SIGTERM (a drain: its sessions are handed over), and waits until each of its
    sessions was adopted and served again; returns the drain and the drained workers.
    Without `take_out`, nginx keeps it in its list (the diagnostic run that measures
    the gateway's own drain: nginx learns of it only from refused connections)."""
    victims = load.live_on(victim)
    owners = {s: s.owner_worker for s in victims}
    drained = {w for w, host in (await workers.refresh()).items() if host == victim}
    check(len(drained) == 2, f"{step.name}: {victim} runs {sorted(drained)}, not 2 workers")
    if take_out:
        said = await fleet.lb_members(*serving)
        log(f"{said.splitlines()[-1] if said else 'lb-members done'} (left out {victim})")
    issued = now()
    await fleet.compose("stop", victim)
    fault = Fault(victim, victims, owners, issued, now())
    log(f"stopped {victim} ({len(victims)} sessions on it) in {fault.effective - issued:.1f} s")
    deadline = time.monotonic() + 30
    while waiting := [s for s in victims if not served_again(s, issued)]:
        ended = [s for s in victims if s.ended]
        check(not ended, f"{step.name}: {len(ended)} sessions of drained {victim} were told they "
              f"are gone: " + describe(ended, issued, owners))
        check(time.monotonic() < deadline, f"{step.name}: {len(waiting)} sessions of drained "
              f"{victim} not adopted and served again within 30 s: " + describe(waiting, issued, owners))
        await asyncio.sleep(0.2)
    return fault, drained


async def rolling_step(fleet: Fleet, load: Load, workers: Workers) -> Step:
    """Every gateway container replaced, one at a time, under the steady load, as
    docs/operations.md ("Rolling replacement") says: take it out of the load balancer,
    stop it (SIGTERM drains it: its sessions are handed over), start it again, wait for
    /healthz and /readyz, put it back."""
    step = Step("rolling replacement")
    await load.ensure_spread()
    start = now()
    judged: list[Step] = []
    for victim in GATEWAYS:
        await load.ensure_spread()
        part = Step(f"replace {victim}")
        part_start = now()
        # Per replacement: the adopters of one drain may be drained in the next, and
        # their counters leave with them.
        counted = await fleet.adoption_counters()
        serving = tuple(g for g in GATEWAYS if g != victim)
        fault, drained = await drain_container(fleet, load, workers, victim, serving, part,
                                               take_out=not ROLLING_IN_PLACE)
        await fleet.compose("start", victim)
        ready_s = await fleet.wait_ready(victim)
        new = {w for w, host in (await workers.refresh()).items() if host == victim}
        check(not new & drained, f"{part.name}: {victim} came back with the drained ids {new & drained}")
        back = now()
        if not ROLLING_IN_PLACE:
            await fleet.lb_members(*GATEWAYS)
        log(f"{victim} replaced: ready {ready_s:.1f} s after its start, back in nginx")
        judge_drain(part, load, fault, part_start, now(), drained,
                    fault.issued if ROLLING_IN_PLACE else back)
        await check_adoption_counters(part, fleet, counted, cause="drain")
        step.notes.append(f"{victim}: " + "; ".join(part.notes) + f"; ready again {ready_s:.1f} s "
                          f"after its start, as {sorted(new)}")
        judged.append(part)
    step.answers = window(load, start, now())
    inits = [a for a in load.inits if start <= a.sent < now()]
    failed = failed_requests(step.answers, inits)
    step.others_errors = len(failed)
    check(not failed, f"{step.name}: {len(failed)} requests failed between the replacements")
    step.adopted = sum(p.adopted for p in judged)
    step.victims = sum(p.victims or 0 for p in judged)
    step.served_again_s = sorted(t for p in judged for t in p.served_again_s)
    adopted = [a for a in step.answers if a.adopted]
    check(len(adopted) == step.adopted, f"{step.name}: {len(adopted)} answers carry mcpgw-adopted, "
          f"{step.adopted} of them for drained sessions")
    return step


async def scale_out_step(fleet: Fleet, load: Load, workers: Workers) -> Step:
    """A fourth gateway container joins (compose profile `scale`): started, ready, put
    into nginx; it then takes new sessions (they are opened on it and served)."""
    step = Step(f"scale out: {SCALE_GATEWAY} joins")
    start = now()
    await fleet.compose("up", "-d", "--no-deps", SCALE_GATEWAY)
    ready_s = await fleet.wait_ready(SCALE_GATEWAY)
    joined = {w for w, host in (await workers.refresh()).items() if host == SCALE_GATEWAY}
    said = await fleet.lb_members(*ALL_GATEWAYS)
    log(f"{SCALE_GATEWAY} ready {ready_s:.1f} s after its start; {said.splitlines()[-1] if said else ''}")
    await load.ensure_spread(ALL_GATEWAYS)
    mine = load.live_on(SCALE_GATEWAY)
    opened = now()
    await wait_until(lambda: all(sum(1 for a in s.answers if a.cls == "ok") >= 3 for s in mine), 30,
                     f"{SCALE_GATEWAY}'s new sessions served")
    await asyncio.sleep(2)
    step.answers = window(load, start, now())
    inits = [a for a in load.inits if start <= a.sent < now()]
    failed = failed_requests(step.answers, inits)
    step.others_errors = len(failed)
    check(not failed, f"{step.name}: {len(failed)} requests failed: "
          f"{[(a.cls, a.status, a.reason, a.edge) for a in failed[:5]]}")
    adopted = [a for a in step.answers if a.adopted]
    check(not adopted, f"{step.name}: {len(adopted)} answers say they adopted a live session")
    served = [a for a in step.answers if a.cls == "ok" and a.owner_worker in joined]
    at_edge = [a for a in step.answers if a.edge == SCALE_GATEWAY and a.sent >= opened]
    check(len(mine) >= SESSIONS_PER_GATEWAY and served and at_edge,
          f"{step.name}: {SCALE_GATEWAY} owns {len(mine)} sessions, served {len(served)} calls as "
          f"owner and {len(at_edge)} as edge")
    step.notes.append(f"{SCALE_GATEWAY} ready {ready_s:.1f} s after its start as {sorted(joined)}; "
                      f"it opened {len(mine)} new sessions and served {len(served)} calls as their "
                      f"owner, {len(at_edge)} requests reached it from nginx; none failed")
    return step


async def scale_in_step(fleet: Fleet, load: Load, workers: Workers) -> Step:
    """The fourth gateway drained and removed: out of nginx, SIGTERM (its sessions are
    handed over and adopted), then its container removed."""
    step = Step(f"scale in: {SCALE_GATEWAY} drained, removed")
    start = now()
    counted = await fleet.adoption_counters()
    fault, drained = await drain_container(fleet, load, workers, SCALE_GATEWAY, GATEWAYS, step)
    await fleet.compose("rm", "-f", SCALE_GATEWAY)
    _, left = await sh("docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}",
                       "--filter", f"label=com.docker.compose.service={SCALE_GATEWAY}")
    check(not left.split(), f"{step.name}: {SCALE_GATEWAY}'s container is still there")
    leases = await workers.refresh()
    check(not drained & set(leases), f"{step.name}: leases of drained workers left: {drained & set(leases)}")
    await asyncio.sleep(1)
    judge_drain(step, load, fault, start, now(), drained, now())
    await check_adoption_counters(step, fleet, counted, cause="drain")
    return step


# --- The SDK through the load balancer --------------------------------------------------


def text_of(result) -> str:
    return "".join(c.text for c in result.content if getattr(c, "type", "") == "text")


# The SDK's counter session calls at least this often, and goes on until its requests
# have landed on every container (nginx's round-robin gets there within a few calls);
# the bound only catches requests that never reach one.
SDK_MIN_CALLS = 12
SDK_MAX_CALLS = 60


def check_counted(values: list[str], edges: set[str]) -> None:
    """The SDK session's counter counted 1, 2, 3, ... and its requests landed on every
    gateway container."""
    check(values == [str(i) for i in range(1, len(values) + 1)], f"SDK counter counted {values}")
    check(set(GATEWAYS) <= edges, f"the counter's {len(values)} requests landed only on {sorted(edges)}")


async def sdk_step(fleet: Fleet, workers: Workers) -> Step:
    """The official SDK client (legacy mode) through nginx."""
    step = Step("SDK client through the LB")
    seen: list[tuple[str, str | None, str | None, float]] = []

    async def on_response(response: httpx2.Response) -> None:
        request = response.request
        if request.method != "POST":
            return
        try:
            body = json.loads(request.content)
        except ValueError:
            return
        if isinstance(body, dict) and body.get("method") == "tools/call":
            seen.append((body["params"]["name"], response.headers.get("mcpgw-edge-worker"),
                         response.headers.get("mcpgw-owner-worker"), response.status_code))

    http = httpx2.AsyncClient(event_hooks={"response": [on_response]},
                              timeout=httpx2.Timeout(30.0, read=300.0))
    start = now()
    async with http, mcp.Client(streamable_http_client(fleet.url, http_client=http),
                                mode="legacy") as client:
        await workers.refresh()
        values: list[str] = []
        edges: set[str] = set()
        while len(values) < SDK_MIN_CALLS or (not set(GATEWAYS) <= edges and len(values) < SDK_MAX_CALLS):
            values.append(text_of(await client.call_tool("counter_increment", {})))
            calls = [(edge, owner) for name, edge, owner, _ in seen if name == "counter_increment"]
            edges = {workers.container(edge) or str(edge) for edge, _ in calls}
        check_counted(values, edges)
        owners = {owner for _, owner in calls}
        check(len(owners) == 1, f"one session answered by several owners: {owners}")
        step.notes.append(f"counter_increment 1..{len(values)} in one session; requests landed on "
                          f"{', '.join(sorted(edges))}; owner {owners.pop()}")
        # slow_stream through a forward: repeat until nginx hands it to a worker other
        # than the owner (5 of 6 workers are).
        for _ in range(10):
            progress_at: list[float] = []

            async def on_progress(progress, total, message):
                progress_at.append(time.monotonic())

            called = time.monotonic()
            result = await client.call_tool("slow_stream", {"count": 5, "interval_ms": 250},
                                            progress_callback=on_progress)
            result_at = time.monotonic()
            _, edge, owner, _ = [s for s in seen if s[0] == "slow_stream"][-1]
            if edge != owner:
                break
        check(edge != owner, "slow_stream was never forwarded in 10 tries")
        check(len(progress_at) == 5, f"slow_stream sent {len(progress_at)} progress notifications, not 5")
        check(all(t < result_at for t in progress_at), "progress arrived after the result")
        # Relayed one by one, the notifications arrive spread over the stream's second;
        # buffered, they would arrive in one burst with the result.
        check(progress_at[-1] - progress_at[0] >= 0.5,
              f"progress arrived in a burst ({progress_at[-1] - progress_at[0]:.3f} s apart)")
        step.notes.append(
            f"slow_stream forwarded {workers.container(edge) or edge} -> "
            f"{workers.container(owner) or owner}: progress at "
            + ", ".join(f"{(t - called) * 1000:.0f}" for t in progress_at)
            + f" ms, result at {(result_at - called) * 1000:.0f} ms ({text_of(result)!r})")
    step.answers = [Answer(None, 0, 0, "ok" if status == 200 else "other", status, "", edge, owner)
                    for _, edge, owner, status in seen]
    step.seconds = now() - start
    return step


# --- Report ----------------------------------------------------------------------------


# Always shown; the other classes only when some step has them.
ALWAYS_SHOWN = ("ok", "unknown", "gone", "outcome_unknown", "not_found", "other")


def print_table(steps: list[Step]) -> None:
    shown = [c for c in CLASSES if c in ALWAYS_SHOWN or any(s.counts()[c] for s in steps)]
    # adopted: answers carrying mcpgw-adopted / the victim sessions that needed one.
    # served again: from the fault to the first and the last victim's adopting answer.
    head = ["step", "requests", *shown, "others' errors", "adopted", "served again", "time"]
    rows = []
    for s in steps:
        counts = s.counts()
        rows.append([s.name, str(len(s.answers)), *[str(counts[c]) for c in shown],
                     str(s.others_errors),
                     f"{s.adopted}/{s.victims}" if s.victims is not None else str(s.adopted),
                     f"{s.served_again_s[0]:.2f}-{s.served_again_s[-1]:.2f} s" if s.served_again_s else "-",
                     f"{s.seconds:.0f} s"])
    widths = [max(len(head[i]), *(len(r[i]) for r in rows)) for i in range(len(head))]
    print()
    print("  ".join(h.ljust(widths[i]) if i == 0 else h.rjust(widths[i]) for i, h in enumerate(head)))
    for r in rows:
        print("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
    print()
    for s in steps:
        for note in s.notes:
            print(f"  {s.name}: {note}")
    print(flush=True)


def recent_answers(session: LoadSession, upto: Answer, n: int = 8) -> str:
    """The answers of `session` up to `upto`, one line each with the workers involved,
    for a failure report: the worker logs (build/compose/logs) say the rest."""
    until = session.answers.index(upto) + 1
    return "\n".join(
        f"  {b.sent:.3f}..{b.done:.3f}s {b.cls} {b.status} {b.reason or b.value} "
        f"edge {b.edge}/{b.edge_worker} owner {b.owner_worker} adopted {b.adopted}"
        for b in session.answers[max(0, until - n):until])


def check_sessions(sessions: list[LoadSession]) -> str:
    """Every session had one owner at a time: the worker that opened it, then each
    worker whose answer said it adopted the session (a worker it never had before),
    and never an earlier owner again; and its counter moved by exactly one per request
    it was told succeeded (a request with an unknown outcome may have moved it)."""
    checked = adoptions = 0
    for s in sessions:
        last = 0
        ambiguous = 0
        between: list[Answer] = []
        owner = s.first_owner_worker
        earlier: list[str] = []
        for a in s.answers:
            if a.cls == "ok":
                if a.adopted:
                    check(bool(a.owner_worker) and a.owner_worker != owner
                          and a.owner_worker not in earlier,
                          f"session {s.sid[:8]}… owned by {owner} (before: {earlier}) was adopted "
                          f"at {a.sent:.1f}s by {a.owner_worker}, not a new owner")
                    earlier.append(owner)
                    owner = a.owner_worker
                    adoptions += 1
                check(a.owner_worker == owner,
                      f"session {s.sid[:8]}… owned by {owner} was answered at {a.sent:.1f}s "
                      f"via {a.edge} by {a.owner_worker}: "
                      + ("its owner before an adoption" if a.owner_worker in earlier
                         else "no answer said that worker adopted it"))
                seen = "; ".join(
                    f"{b.cls} {b.status} {b.reason} at {b.sent:.1f}s "
                    f"via {b.edge}: {b.message[:160]}" for b in between)
                check(a.value is not None and last + 1 <= a.value <= last + 1 + ambiguous,
                      f"session {s.sid[:8]}… owned by {owner}: counter "
                      f"went {last} -> {a.value} at {a.sent:.1f}s via {a.edge} "
                      f"with {ambiguous} requests of unknown outcome between; "
                      f"answers between: [{seen}]; its last answers, "
                      f"{s.answers.index(a) + 1} in all:\n" + recent_answers(s, a))
                last, ambiguous, between = a.value, 0, []
                checked += 1
            else:
                between.append(a)
                if a.cls in ("outcome_unknown", "answer_lost", "lb_error", "timeout", "transport"):
                    ambiguous += 1
    return (f"{len(sessions)} sessions, {checked} counted answers, {adoptions} adoptions: one "
            f"owner at a time each, no count lost or doubled")


async def save_logs(fleet: Fleet) -> None:
    """Every container's log, for reading after the fleet is gone."""
    directory = ROOT / "build" / "compose" / "logs"
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.log"):
        old.unlink()
    for service in ("certs", "redis", "upstream", *ALL_GATEWAYS, "lb"):
        try:
            (directory / f"{service}.log").write_text(await fleet.logs(service))
        except TestFailure:
            continue
    log(f"container logs in {directory.relative_to(ROOT)}/")


# --- Self-test -------------------------------------------------------------------------


def expect_failure(what: str, run, says: str) -> None:
    """`run()` must fail its check with a message containing `says`."""
    try:
        run()
    except TestFailure as e:
        check(says in str(e), f"self-test {what}: failed, but with {str(e)[:300]!r}")
        print(f"  ok: {what}: {str(e).splitlines()[0][:150]}")
        return
    raise TestFailure(f"self-test {what}: the check passed")


async def self_test() -> int:
    """Each check of the run fed an input that violates it (it must fail) and one that
    does not (it must pass): no fleet needed, a second's work. Run first by
    scripts/compose-test.sh, so that a check that can no longer fail fails the run."""
    print("self-test of the checks:")
    # Fencing: the worker declared dead must log its own fencing line.
    w, other = "gw2-17-0a0b0c", "gw2-18-0d0e0f"
    ordinary = (f"2026-12-01T10:00:00Z  WARN mcpgw::forward::caller: forward failed detail=\"worker "
                f"{other} was declared dead\" worker={w}\n"
                f"2026-12-01T10:00:01Z ERROR mcpgw::lease: lease lost: this worker was declared dead "
                f"worker=\"{w}\"\n")
    fence = f"2026-12-01T10:00:01Z ERROR mcpgw::worker: {FENCE_LINE}; sessions dropped, exiting for a fresh id"
    check(fenced_workers(ordinary, {w}) == set(), "self-test fencing: ordinary lines taken for fencing")
    check(fenced_workers(ordinary + f"{fence} worker={other} dropped=3\n", {w, other}) == {other},
          "self-test fencing: another worker's fencing line taken for this one's")
    check(fenced_workers(ordinary + f"{fence} worker={w} dropped=3\n", {w}) == {w},
          "self-test fencing: the worker's own fencing line not found")
    print("  ok: fencing: ordinary lines and another worker's fencing line do not count")
    # A second pause that shows nothing fails instead of pausing again.
    frozen = [Answer(None, 1, 2, "gone", 404, "session_gone", "gw1", None)]
    check(must_pause_again("pause", "gw2", 1, set(), frozen), "self-test pause: first empty pause not retried")
    check(not must_pause_again("pause", "gw2", 2, {w}, frozen), "self-test pause: a pause that fenced retried")
    expect_failure("second pause without a dead worker",
                   lambda: must_pause_again("pause", "gw2", 2, set(), frozen), "twice, no worker")
    expect_failure("second pause without answers while frozen",
                   lambda: must_pause_again("pause", "gw2", 2, {w}, []), "twice, no worker")

    # A victim session's answers: transient ones while the death is proven, one
    # adopting answer from a live worker, then the adopter's; nothing else.
    def answer(cls: str, edge: str, sent: float, owner: str | None = None, value: int | None = None,
               adopted: str | None = None, session: LoadSession | None = None) -> Answer:
        return Answer(session, sent, sent + 0.1, cls, None, "", edge, owner, value, adopted=adopted)

    dead = {"gw2-w1", "gw2-w2"}
    adopting = answer("ok", "gw3", 8.5, "gw1-w1", adopted="death")
    served = [answer("ok", "gw1", 4.0, "gw2-w1"), answer("outcome_unknown", "gw3", 5.5),
              answer("unknown", "gw1", 6.0), answer("answer_lost", "gw3", 6.2),
              answer("lb_error", "gw2", 6.5), adopting, answer("ok", "gw1", 9.0, "gw1-w1"),
              answer("unknown", "gw2", 9.5), answer("unknown", "gw3", 9.7),
              answer("ok", "gw3", 10.0, "gw1-w1")]
    check(victim_problems(served, "gw2", "gw2-w1", 5.0, dead) == [],
          f"self-test victim answers: an adopted session refused: "
          f"{victim_problems(served, 'gw2', 'gw2-w1', 5.0, dead)}")
    check(victim_problems(served[:5], "gw2", "gw2-w1", 5.0, dead, adopted_once=False) == [],
          "self-test victim answers: a session still waiting for adoption refused while frozen")

    def expect_problem(what: str, answers: list[Answer], says: str, adopted_once: bool = True) -> None:
        problems = victim_problems(answers, "gw2", "gw2-w1", 5.0, dead, adopted_once)
        check(any(says in p for p in problems), f"self-test victim answers: {what} accepted "
              f"(problems: {problems})")

    def with_header_off(a: Answer) -> Answer:
        return Answer(a.session, a.sent, a.done, a.cls, a.status, a.reason, a.edge, a.owner_worker, a.value)

    for cls in ("gone", "not_found"):
        expect_problem(f"a victim told {cls}", served[:3] + [answer(cls, "gw1", 7.0)] + served[3:],
                       f"told {cls}")
        expect_problem(f"a victim told {cls} after its adoption", served + [answer(cls, "gw3", 11.0)],
                       f"told {cls}")
    expect_problem("two mcpgw-adopted answers for one session",
                   served + [answer("ok", "gw3", 11.0, "gw3-w1", adopted="death")], "2 answers carry")
    expect_problem("two mcpgw-adopted answers while frozen",
                   served + [answer("ok", "gw3", 11.0, "gw1-w1", adopted="death")], "2 answers carry",
                   adopted_once=False)
    expect_problem("a victim never adopted", [with_header_off(a) for a in served], "0 answers carry")
    expect_problem("an ok from the dead owner after the adoption",
                   served + [answer("ok", "gw2", 11.0, "gw2-w1")], "after its adoption by gw1-w1, served by ok")
    expect_problem("an ok from another dead worker after the adoption",
                   served + [answer("ok", "gw2", 11.0, "gw2-w2")], "after its adoption by gw1-w1, served by ok")
    expect_problem("an ok from the old owner after the fault, before adoption",
                   served[:3] + [answer("ok", "gw2", 7.0, "gw2-w1")] + served[3:], "before its adoption, ok")
    expect_problem("an adoption by a dead worker",
                   served[:5] + [answer("ok", "gw1", 8.5, "gw2-w2", adopted="death")], "adopted by ok")
    expect_problem("an adoption said to follow a drain",
                   served[:5] + [answer("ok", "gw1", 8.5, "gw1-w1", adopted="drain")], "mcpgw-adopted: drain")
    for bad in (answer("lb_error", "gw1", 7.0), answer("timeout", "gw3", 7.0), answer("other", "gw2", 7.0)):
        expect_problem(f"{bad.cls} via {bad.edge} before the adoption", served[:3] + [bad] + served[3:],
                       f"before its adoption, {bad.cls}")
    for cls in ("outcome_unknown", "answer_lost", "lb_error", "timeout", "other"):
        expect_problem(f"{cls} through a surviving container after the adoption",
                       served + [answer(cls, "gw3", 11.0)], f"after its adoption, {cls}")
    print("  ok: victim answers: gone, not_found, two or no adoptions, a dead owner's ok, an adoption "
          "by a dead worker or after a drain, lb_error elsewhere, timeout, other, errors after adoption refused")

    # Served again: an adopting answer and one more ok from the adopter.
    victim_session = LoadSession("victim-sid", "gw1-w1", "gw1", 0, first_owner_worker="gw2-w1")
    victim_session.answers = served[:6]
    check(not served_again(victim_session, 5.0), "self-test served again: an adoption alone counted")
    victim_session.answers = served
    check(served_again(victim_session, 5.0), "self-test served again: an adopted session not counted")
    told_gone = LoadSession("gone-sid", "gw2-w1", "gw2", 0, ended=True,
                            answers=served[:3] + [answer("gone", "gw1", 7.0)])
    try:
        await wait_adopted(Fault("gw2", [victim_session, told_gone],
                                 {victim_session: "gw2-w1", told_gone: "gw2-w1"}, 5.0, 5.0), "adoption")
    except TestFailure as e:
        check("told they are gone" in str(e), f"self-test wait: failed, but with {e}")
    else:
        raise TestFailure("self-test wait: a session told gone was waited for")
    print("  ok: waiting for adoption: an adoption without progress does not count; a session told gone fails at once")

    # A whole fault step: the victim adopted, another session untouched; then another
    # session adopted, or served by a dead worker after the fault.
    judged_fleet = Fleet("10.211.0", 1)
    judged_workers = Workers(judged_fleet)
    judged_workers.container_of.update({"gw1-w1": "gw1", "gw2-w1": "gw2", "gw3-w1": "gw3"})
    judged_load = Load(judged_fleet, judged_workers)

    def judged(extra: list[Answer]) -> Step:
        load = judged_load
        victim = LoadSession("victim-sid", "gw1-w1", "gw1", 0, first_owner_worker="gw2-w1")
        other = LoadSession("other-sid", "gw3-w1", "gw3", 0)
        victim.answers = [answer(a.cls, a.edge, a.sent, a.owner_worker, a.value, a.adopted, victim)
                          for a in served]
        other.answers = [answer("ok", "gw1", 6.0 + i, "gw3-w1", session=other) for i in range(4)]
        other.answers += [Answer(other, a.sent, a.done, a.cls, a.status, a.reason, a.edge,
                                 a.owner_worker, a.value, adopted=a.adopted) for a in extra]
        load.sessions = [victim, other]
        load.answers = sorted(victim.answers + other.answers, key=lambda a: a.sent)
        step = Step("judged")
        fault = Fault("gw2", [victim], {victim: "gw2-w1"}, 5.0, 5.0)
        judge_fault(step, load, fault, 1.0, 20.0, dead)
        return step

    step = judged([])
    check(step.adopted == 1 and step.victims == 1 and len(step.served_again_s) == 1
          and abs(step.served_again_s[0] - 3.6) < 1e-6,
          f"self-test judge: adopted {step.adopted}/{step.victims}, served again {step.served_again_s}")
    expect_failure("another session adopted",
                   lambda: judged([answer("ok", "gw1", 12.0, "gw1-w1", adopted="death")]),
                   "sessions whose owner lives were adopted")
    expect_failure("a dead worker serving after the fault",
                   lambda: judged([answer("ok", "gw1", 12.0, "gw2-w2")]), "name a dead worker")

    # The counters: one owner at a time, a new one only where an answer says it adopted.
    def history(*answers: Answer) -> list[LoadSession]:
        session = LoadSession("sid-history", "gw2-w1", "gw2", 0)
        session.answers = list(answers)
        return [session]

    first = [answer("ok", "gw1", 1, "gw2-w1", 1), answer("ok", "gw3", 2, "gw2-w1", 2),
             answer("outcome_unknown", "gw1", 3)]
    adopted = [answer("ok", "gw3", 4, "gw1-w1", 4, adopted="death"), answer("ok", "gw1", 5, "gw1-w1", 5)]
    check_sessions(history(*first, *adopted))
    check_sessions(history(*first[:2], answer("ok", "gw3", 4, "gw1-w1", 3, adopted="death")))
    expect_failure("the old owner serving after the adoption",
                   lambda: check_sessions(history(*first, *adopted, answer("ok", "gw2", 6, "gw2-w1", 6))),
                   "its owner before an adoption")
    expect_failure("a new owner without an adopting answer",
                   lambda: check_sessions(history(*first, with_header_off(adopted[0]))),
                   "no answer said that worker adopted it")
    expect_failure("an adoption back to an earlier owner",
                   lambda: check_sessions(history(*first, *adopted,
                                                  answer("ok", "gw2", 6, "gw2-w1", 6, adopted="death"))),
                   "not a new owner")
    expect_failure("a count doubled at the adoption",
                   lambda: check_sessions(history(*first[:2], answer("ok", "gw3", 4, "gw1-w1", 4,
                                                                     adopted="death"))),
                   "counter went 2 -> 4")
    # A drained container's sessions: all ok, the old owner until one answer adopts
    # the session after the drain, then the adopter alone.
    drained_workers = {"gw2-w1", "gw2-w2"}
    handed = [answer("ok", "gw1", 4.0, "gw2-w1", 5), answer("ok", "gw3", 4.2, "gw2-w1", 6),
              answer("ok", "gw1", 4.5, "gw3-w1", 7, adopted="drain"), answer("ok", "gw3", 4.7, "gw3-w1", 8)]
    check(drained_problems(handed, drained_workers, "gw2-w1") == [],
          f"self-test drain: a handed-over session refused: {drained_problems(handed, drained_workers, 'gw2-w1')}")

    def expect_drained(what: str, answers: list[Answer], says: str) -> None:
        problems = drained_problems(answers, drained_workers, "gw2-w1")
        check(any(says in p for p in problems), f"self-test drain: {what} accepted (problems: {problems})")

    for cls in ("unknown", "gone", "not_found", "outcome_unknown", "lb_error", "transport"):
        expect_drained(f"a drained session told {cls}", handed[:2] + [answer(cls, "gw1", 4.4)] + handed[2:],
                       f"told {cls}")
    expect_drained("a drained session never adopted", [with_header_off(a) for a in handed], "0 answers carry")
    expect_drained("a drained session adopted twice",
                   handed + [answer("ok", "gw1", 5.0, "gw1-w1", 9, adopted="drain")], "2 answers carry")
    expect_drained("an adoption said to follow a death",
                   handed[:2] + [answer("ok", "gw1", 4.5, "gw3-w1", 7, adopted="death")], "mcpgw-adopted: death")
    expect_drained("an adoption by a drained worker",
                   handed[:2] + [answer("ok", "gw1", 4.5, "gw2-w2", 7, adopted="drain")], "adopted by ok")
    expect_drained("the drained owner serving after the adoption",
                   handed + [answer("ok", "gw1", 5.0, "gw2-w1", 9)], "after its adoption by gw3-w1")
    expect_drained("another worker serving before the adoption",
                   [answer("ok", "gw1", 4.0, "gw1-w1", 5)] + handed[2:], "before its adoption")
    refused_init = Answer(None, 4.0, 4.1, "unknown", 503, "draining", "gw2", None)
    check(failed_requests(handed, [refused_init]) == [refused_init],
          "self-test drain: a refused initialize not counted as a failed request")
    print("  ok: drain: any non-ok answer (initialize too), no or two adoptions, an adoption after a death or "
          "by a drained worker, the old owner after the adoption refused")

    def judged_drain(extra: list[Answer], edge_after: str = "gw1") -> Step:
        load = judged_load
        victim = LoadSession("drained-sid", "gw2-w1", "gw2", 0)
        other = LoadSession("other-sid", "gw3-w1", "gw3", 0)
        victim.answers = [answer(a.cls, a.edge, a.sent, a.owner_worker, a.value, a.adopted, victim)
                          for a in handed]
        other.answers = [answer("ok", edge_after, 4.0 + i / 4, "gw3-w1", session=other) for i in range(4)]
        other.answers += [Answer(other, a.sent, a.done, a.cls, a.status, a.reason, a.edge,
                                 a.owner_worker, a.value, adopted=a.adopted) for a in extra]
        load.sessions = [victim, other]
        load.answers = sorted(victim.answers + other.answers, key=lambda a: a.sent)
        load.inits = []
        step = Step("drained")
        judge_drain(step, load, Fault("gw2", [victim], {victim: "gw2-w1"}, 3.5, 4.3), 1.0, 20.0,
                    drained_workers, 10.0)
        return step

    step = judged_drain([])
    check(step.adopted == 1 and step.victims == 1, f"self-test judge drain: adopted {step.adopted}/{step.victims}")
    expect_failure("a drain step with a failed request of another session",
                   lambda: judged_drain([answer("unknown", "gw1", 6.0)]), "requests failed")
    expect_failure("a drain step adopting another session",
                   lambda: judged_drain([answer("ok", "gw1", 6.0, "gw1-w1", adopted="drain")]),
                   "were not drained were adopted")
    expect_failure("a drained worker answering after its container stopped",
                   lambda: judged_drain([answer("ok", "gw1", 6.0, "gw2-w2")]), "name a drained worker")
    expect_failure("nginx sending to a container it was told to leave out",
                   lambda: judged_drain([], edge_after="gw2"), "after nginx was told to leave it out")
    await judged_load.client.aclose()
    # The adoption counters against the headers, and what a worker's /metrics says.
    metrics = ('# TYPE mcpgw_sessions_adopted counter\nmcpgw_sessions_adopted_total{cause="death"} 3\n'
               'mcpgw_sessions_adopted_total{cause="drain"} 0\nmcpgw_adoptions_refused_total{why="stdio"} 0\n'
               'mcpgw_sessions_adopted_created{cause="death"} 1.7e9\n# EOF\n')
    check(adoption_counts(metrics) == {"death": 3, "drain": 0, "refused": 0},
          f"self-test metrics: read {adoption_counts(metrics)}")

    def counts(death: int, drain: int = 0, refused: int = 0) -> dict[str, int]:
        return {"death": death, "drain": drain, "refused": refused}

    before = {"a": counts(2), "b": counts(0), "gone": counts(1)}
    after = {"a": counts(5), "b": counts(1), "new": counts(1)}
    check(adoption_count_problems(before, after, 5) == [], "self-test metrics: matching counts refused")
    for what, bad_after, answers, says in (
            ("a count above the headers", after, 4, "counted 5 adoptions"),
            ("a count below the headers", after, 6, "counted 5 adoptions"),
            ("a refused adoption", after | {"b": counts(1, refused=1)}, 5, "refused"),
            ("a drain adoption", after | {"b": counts(1, drain=1)}, 5, "after a drain")):
        problems = adoption_count_problems(before, bad_after, answers)
        check(any(says in p for p in problems), f"self-test metrics: {what} accepted ({problems})")
    drained_before = {"a": counts(0), "b": counts(0)}
    drained_after = {"a": counts(0, drain=3), "b": counts(0, drain=2)}
    check(adoption_count_problems(drained_before, drained_after, 5, "drain") == [],
          "self-test metrics: matching drain counts refused")
    for what, bad_after, answers, says in (
            ("drain adoptions below the headers", drained_after, 6, "counted 5 adoptions after a drain"),
            ("a death adoption in a drain step", drained_after | {"b": counts(1, drain=2)}, 5, "after a death"),
            ("a refused adoption in a drain step", drained_after | {"b": counts(0, 2, 1)}, 5, "refused")):
        problems = adoption_count_problems(drained_before, bad_after, answers, "drain")
        check(any(says in p for p in problems), f"self-test metrics: {what} accepted ({problems})")
    print("  ok: adoption metrics: counts above or below the headers, refused, drain adoptions in a death step and death adoptions in a drain step refused")
    # The adoption records: sealed, never in the clear, never missing.
    sealed = 'live|http|ab12|{"v":1,"route":"demo","upstream_session":"sealed:1a2b3c4d:AAAA"}'
    clear = 'live|http|ab12|{"v":1,"route":"demo","upstream_session":"clear:upstream-sid"}'
    check(record_problems([sealed, sealed]) == ([], {"1a2b3c4d"}), "self-test records: sealed ones refused")
    for what, records in (("a record in the clear", [sealed, clear]), ("a missing record", [sealed, ""])):
        check(len(record_problems(records)[0]) == 1, f"self-test records: {what} accepted")
    print("  ok: adoption records: one in the clear, one missing refused")
    # Rotation: every worker alive at the stage reloaded and uses the stage's material.
    old, new = "old-ca", "new-ca"

    def state(reloads: int, cas: list[str], leaf: str) -> dict:
        return {"mesh_cert": {"reloads": reloads, "ca_fingerprints": cas, "leaf_fingerprint": leaf}}

    alive = {"a", "b"}
    start = {x: state(0, [old], f"{x}-leaf0") for x in alive}
    begun = {x: state(1, [old, new], f"{x}-leaf0") for x in alive}
    reissued = {x: state(2, [old, new], f"{x}-leaf1") for x in alive}
    finished = {x: state(3, [new], f"{x}-leaf1") for x in alive}
    for stage, before, after in (("begin", start, begun), ("reissue", begun, reissued),
                                 ("finish", reissued, finished)):
        check(rotation_problems(stage, alive, start, before, after) == [],
              f"self-test rotation: a complete {stage} refused")
        one_missing = {x: v for x, v in after.items() if x != "b"}
        check(len(rotation_problems(stage, alive, start, before, one_missing)) == 1,
              f"self-test rotation {stage}: a worker without /state accepted")
        not_reloaded = after | {"b": before["b"]}
        problems = rotation_problems(stage, alive, start, before, not_reloaded)
        check(len(problems) == 1 and problems[0].startswith("b: no reload"),
              f"self-test rotation {stage}: a worker that did not reload accepted ({problems})")
        old_material = after | {"b": {"mesh_cert": before["b"]["mesh_cert"] | {"reloads": 9}}}
        problems = rotation_problems(stage, alive, start, before, old_material)
        check(len(problems) == 1 and "does not use the material" in problems[0],
              f"self-test rotation {stage}: a worker on the old material accepted ({problems})")
    print("  ok: rotation: a worker missing, not reloaded, or on the old material refused at each stage")
    # The SDK session's counter and edges.
    check_counted(["1", "2", "3"], set(GATEWAYS))
    expect_failure("SDK edges", lambda: check_counted(["1", "2"], {"gw1", "gw2"}), "landed only on")
    expect_failure("SDK counter", lambda: check_counted(["1", "3"], set(GATEWAYS)), "counted")
    # A load slot that dies fails the step at once, with its traceback.
    load = Load(Fleet("10.211.0", 1), None)  # type: ignore[arg-type]

    async def crashing_drive(session: LoadSession) -> None:
        await asyncio.sleep(0.05)
        raise RuntimeError("a load slot's bug")

    ran_on: list[bool] = []

    async def long_step() -> Step:
        await asyncio.sleep(30)
        ran_on.append(True)
        return Step("never")

    load.drive = crashing_drive  # type: ignore[method-assign]
    load.start_slot(LoadSession("sid", "w", "gw1", 0))
    try:
        await unless_load_crashed(load, long_step())
    except TestFailure as e:
        check("RuntimeError: a load slot's bug" in str(e) and "Traceback" in str(e),
              f"self-test load crash: failed without the slot's traceback: {e}")
    else:
        raise TestFailure("self-test load crash: the step ran on")
    check(not ran_on, "self-test load crash: the step ran to its end")
    await load.stop()
    check(load.crash_report() is not None, "self-test load crash: forgotten after stop")
    print("  ok: load crash: a crashed slot fails the step with its traceback")
    print("self-test passed", flush=True)
    return 0


# --- Main ------------------------------------------------------------------------------


async def main() -> int:
    check(bool(PROJECT), "MCPGW_COMPOSE_PROJECT is not set: run this through scripts/compose-test.sh")
    subnet_prefix = await free_subnet_prefix()
    fleet = Fleet(subnet_prefix, free_port())
    log(f"project {PROJECT}: network {subnet_prefix}.0/24, load balancer {fleet.url}, lease {LEASE_S:g} s")
    up_started = now()
    await fleet.compose("up", "-d", "--no-build")
    await fleet.wait_healthy("lb")
    log(f"fleet up and healthy in {now() - up_started:.1f} s")
    workers = Workers(fleet)
    leases = await workers.refresh()
    check(sorted(set(leases.values())) == list(GATEWAYS) and len(leases) == 2 * len(GATEWAYS),
          f"expected 2 workers on each of {GATEWAYS}, the directory has {leases}")
    steps: list[Step] = []
    steps.append(await sdk_step(fleet, workers))
    log("SDK checks passed")

    load = Load(fleet, workers)
    refresher = asyncio.create_task(workers.keep_fresh())
    failure: Exception | None = None
    try:
        for run in (lambda: steady_step(fleet, load),
                    lambda: kill_step(fleet, load, workers, "gw1"),
                    lambda: pause_step(fleet, load, workers, "gw2"),
                    lambda: disconnect_step(fleet, load, workers, "gw3"),
                    lambda: rotation_step(fleet, load),
                    lambda: rolling_step(fleet, load, workers),
                    lambda: scale_out_step(fleet, load, workers),
                    lambda: scale_in_step(fleet, load, workers)):
            started = now()
            step = await unless_load_crashed(load, run())
            step.seconds = now() - started
            steps.append(step)
            log(f"{step.name}: passed ({step.seconds:.0f} s)")
    except TestFailure as e:
        failure = e
    finally:
        refresher.cancel()
        await load.stop()
    # A slot that crashed while the load wound down is reported too.
    crashes = load.crash_report()
    if crashes is not None and (failure is None or crashes not in str(failure)):
        failure = TestFailure(crashes + (f"\nand then: {failure}" if failure else ""))
    print_table(steps)
    await save_logs(fleet)
    if failure is not None:
        log(f"FAILED: {failure}")
        return 1
    log(check_sessions(load.sessions))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(self_test() if sys.argv[1:] == ["--self-test"] else main()))
    except TestFailure as e:
        log(f"FAILED: {e}")
        sys.exit(1)
