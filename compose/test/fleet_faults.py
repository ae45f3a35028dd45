"""`make compose-test`: the compose fleet, driven from outside, under the faults a
fleet of hosts meets.

Started by scripts/compose-test.sh, which builds the images, names a unique compose
project, and tears everything down afterwards whatever happens here. This driver:

1. brings the fleet up (compose/docker-compose.yml, 3 gateway containers x 2 workers,
   leases of 3 s) on a free /24 and a free host port for the load balancer;
2. runs the official MCP Python SDK client in legacy mode through nginx:
   counter_increment counts 1, 2, 3, ... while its requests land on every container,
   and slow_stream's progress arrives before its result through a forward;
3. starts a steady load: legacy sessions on every container, each calling
   counter_increment in a loop (raw HTTP, so every status, reason and header is seen);
4. under that load: `docker kill` one gateway container, `docker pause` one past its
   lease, `docker network disconnect` one, and a full certificate rotation, checking
   after each what clients were told;
5. checks that no session was ever served by two owners and that every session's
   counter moved by exactly one per request it was told succeeded;
6. prints one table: step, requests, answers by class, time to the first truthful
   answer.

Requests are classified by what the client got: ok; `unknown` (503,
ownership_unknown / lease_in_doubt: retry the same session); `gone` (404,
session_gone: initialize again); `outcome_unknown` (502: the owner died with the
request); `answer_lost` (502 outcome_unknown with `session_may_continue`: the request
reached a live owner and its answer was lost; the session goes on); `not_found` (404
session_not_found); `lb_error` (nginx's own 502: the gateway process that held the
connection died, the one answer no gateway can give); `timeout`; `transport`; `other`.
The first four are the truthful answers of the README's table; for a victim's session
nothing else is, but `lb_error` for a request in flight at the victim's own edge.

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

TRUTHFUL = ("unknown", "gone", "outcome_unknown", "answer_lost")
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
            "MCPGW_LB_PORT": str(lb_port),
            "MCPGW_LB_BIND": "127.0.0.1",
            "MCPGW_SUBNET_PREFIX": subnet_prefix,
        }
        self.url = f"http://127.0.0.1:{lb_port}/mcp"
        # Compose pins each gateway's address (docker-compose.yml).
        self.ip = {name: f"{subnet_prefix}.{11 + i}" for i, name in enumerate(GATEWAYS)}

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

    async def worker_states(self, records: dict[str, dict]) -> dict[str, dict]:
        """Worker id -> the worker's own `GET /state` (README "Admin listener"), for the
        leased workers in `records`. The admin listeners are on each container's
        loopback, so they are read from inside it (bash's /dev/tcp: no curl there); the
        id is the one the worker reports, not the one the lease was found under."""
        ports: dict[str, list[str]] = {}
        for record in records.values():
            if record.get("admin") and record["host"] in GATEWAYS:
                ports.setdefault(record["host"], []).append(record["admin"].rsplit(":", 1)[-1])
        script = ('for port in "$@"; do (exec 3<>"/dev/tcp/127.0.0.1/$port" && '
                  'printf "GET /state HTTP/1.0\\r\\nHost: 127.0.0.1\\r\\n\\r\\n" >&3 && cat <&3) 2>/dev/null; '
                  f'echo; echo {STATE_END}; done')
        states: dict[str, dict] = {}
        for host, host_ports in sorted(ports.items()):
            _, out = await sh("docker", "exec", await self.container(host), "bash", "-c", script, "_",
                              *host_ports, check_status=False, timeout=30)
            for reply in out.split(STATE_END):
                state = parse_state(reply)
                if state is not None:
                    states[state["worker_id"]] = state
        return states

    async def logs(self, service: str) -> str:
        """The container's output, stdout and stderr (where the gateways log)."""
        process = await asyncio.create_subprocess_exec(
            "docker", "logs", "-t", await self.container(service),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await process.communicate()
        return out.decode(errors="replace")


# Ends each worker's /state reply in the output of `Fleet.worker_states`' script.
STATE_END = "@@mcpgw-state-end@@"


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
    owner_worker: str
    owner: str
    opened: float
    next_id: int = 2
    ended: bool = False
    answers: list["Answer"] = field(default_factory=list)


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
            return Answer(session, sent, done, "ok", status, "", edge, owner, value), response
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
                      message=str(error.get("message", ""))), response

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
        return answer

    async def drive(self, session: LoadSession) -> None:
        """One load slot: a session used until it is gone, then (as the README tells a
        client) a new session in its place."""
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

    async def ensure_spread(self) -> None:
        """Opens sessions until every gateway container owns SESSIONS_PER_GATEWAY live
        ones; a new session on a container that has enough is closed again."""
        for _ in range(20 * len(GATEWAYS) * SESSIONS_PER_GATEWAY):
            missing = [g for g in GATEWAYS if len(self.live_on(g)) < SESSIONS_PER_GATEWAY]
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
        counts = {g: len(self.live_on(g)) for g in GATEWAYS}
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
    first_truthful_s: float | None = None
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


async def wait_all_ended(victims: list[LoadSession], what: str) -> None:
    """Waits until every victim session was told it is gone; says what the ones still
    open were answered when that does not happen."""
    try:
        await wait_until(lambda: all(s.ended for s in victims), LEASE_S * 5 + 20, what)
    except TestFailure as e:
        open_ones = [s for s in victims if not s.ended]
        raise TestFailure(f"{e}; still open: " + "; ".join(
            f"{s.sid[:8]}… (owner {s.owner_worker}): " + " ".join(
                f"{a.cls}/{a.reason or a.status}@{a.edge}" for a in s.answers[-6:])
            for s in open_ones[:4]))


def window(load: Load, start: float, end: float) -> list[Answer]:
    return [a for a in load.answers if start <= a.sent < end]


def first_truthful(victims: list[LoadSession], since: float) -> float | None:
    times = [a.done - since for s in victims for a in s.answers
             if a.done >= since and a.cls in TRUTHFUL]
    return min(times) if times else None


@dataclass
class Fault:
    """When a fault was made: `issued` just before the docker command, `effective`
    when it returned. A request sent after `effective` cannot have been served by the
    victim; answers are timed from `issued` (the conservative side)."""
    victim: str
    victims: list[LoadSession]
    issued: float
    effective: float


def summary(answers: list[Answer]) -> str:
    return ", ".join(f"{c}={sum(1 for a in answers if a.cls == c)}"
                     for c in CLASSES if any(a.cls == c for a in answers))


def untruthful(answers: list[Answer], victim: str, effective: float) -> list[Answer]:
    """The answers to a victim container's sessions, after its fault, that the README's
    table does not allow: all but `session_gone`, `outcome_unknown`, a retryable 503,
    and nginx's own 502 for a request in flight at the victim's own edge (the one
    answer no gateway can give). An ok counts only for a request sent before the fault
    took effect. `session_not_found` is not among them: the owner's sessions were
    reclaimed, and a client must be told they are gone."""
    return [a for a in answers
            if not (a.cls in TRUTHFUL
                    or (a.cls == "lb_error" and a.edge == victim)
                    or (a.cls == "ok" and a.sent < effective))]


def judge_fault(step: Step, load: Load, fault: Fault, start: float, end: float,
                resumed: set[str] = frozenset(), held_until: float | None = None) -> None:
    """What every fault step must show: the victim container's sessions got only
    truthful answers after the fault and all ended with a 404 (initialize again),
    except those of a worker that nobody declared dead (`resumed`: it kept its lease,
    so serving its sessions again is right); every other session saw no error through
    any other container."""
    victim = fault.victim
    victims = [s for s in fault.victims if s.owner_worker not in resumed]
    kept = [s for s in fault.victims if s.owner_worker in resumed]
    step.answers = window(load, start, end)
    after = [a for s in victims for a in s.answers if a.done >= fault.issued]
    served = [a for a in after if a.cls == "ok" and a.sent >= fault.effective]
    check(not served, f"{step.name}: {len(served)} requests of the victim's sessions were "
          f"answered ok after the fault (by {served[0].owner_worker if served else ''})")
    lies = untruthful(after, victim, fault.effective)
    check(not lies, f"{step.name}: victim sessions got untruthful answers: "
          f"{[(a.cls, a.status, a.reason, a.edge, a.message) for a in lies[:5]]}")
    check(all(s.ended for s in victims), f"{step.name}: not every victim session ended")
    if kept:
        # Told "gone" (or "outcome unknown") and then served again would be a lie.
        contradicted = [a for s in kept for a in s.answers
                        if a.done >= fault.issued and a.cls in ("gone", "not_found", "outcome_unknown")]
        check(not contradicted, f"{step.name}: sessions of a worker that resumed its lease were "
              f"told {[(a.cls, a.message) for a in contradicted[:3]]}")
        step.notes.append(f"{len(kept)} of its sessions belonged to {sorted(resumed)}, which nobody "
                          f"declared dead (their requests were waiting at {victim} itself): it "
                          f"resumed its lease and serves them again, as designed")
    victim_set = set(fault.victims)
    others = [a for a in step.answers if a.session not in victim_set]
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
    step.notes.append(f"its {len(fault.victims)} sessions, answers after the fault: " + "; ".join(
        " ".join(f"{a.cls}@{a.done - fault.issued:.1f}s" + (f"[{a.edge}]" if a.edge == victim else "")
                 for a in s.answers if a.done >= fault.issued)[:160] for s in fault.victims))
    step.first_truthful_s = first_truthful(fault.victims, fault.issued)
    check(step.first_truthful_s is not None,
          f"{step.name}: no truthful answer for the victim's sessions; they got "
          f"{[(round(a.done - fault.issued, 2), a.cls, a.status, a.reason, a.edge) for a in after[:12]]}")
    failed_inits = [a for a in load.inits if start <= a.sent < end and a.cls != "ok"]
    if failed_inits:
        step.notes.append(f"{len(failed_inits)} initialize attempts were refused or lost and "
                          f"retried: " + "; ".join(sorted({f"{a.cls} {a.status or ''} {a.reason} "
                                                           f"{a.message[:70]}".strip()
                                                           for a in failed_inits})))


async def settle(workers: Workers, fault: Fault, since: float) -> tuple[set[str], set[str]]:
    """Waits until each of the victim's sessions is settled: told it is gone, or served
    again after `since` by its own owner, which nobody declared dead meanwhile (it
    resumed its lease). Returns (resumed owners, owners declared dead)."""
    deadline = time.monotonic() + LEASE_S * 5 + 20
    while True:
        live = await workers.refresh()

        def settled(s: LoadSession) -> bool:
            return s.ended or (s.owner_worker in live and any(
                a.cls == "ok" and a.sent >= since for a in s.answers))

        if all(settled(s) for s in fault.victims):
            break
        if time.monotonic() > deadline:
            open_ones = [s for s in fault.victims if not settled(s)]
            raise TestFailure(f"{fault.victim}'s sessions did not settle (gone, or served by a "
                              f"resumed owner): " + "; ".join(
                                  f"{s.sid[:8]}… (owner {s.owner_worker}, lease "
                                  f"{'live' if s.owner_worker in live else 'gone'}): " + " ".join(
                                      f"{a.cls}/{a.reason or a.status}@{a.edge}" for a in s.answers[-6:])
                                  for s in open_ones[:4]))
        await asyncio.sleep(0.5)
    owners = {s.owner_worker for s in fault.victims}
    resumed = owners & set(live)
    return resumed, owners - resumed


# What a worker logs when it finds that it was declared dead and fences itself
# (`Worker::fence`, gateway/src/worker.rs), with its own id as the `worker` field. The
# words "declared dead" alone are also in other lines (the lease check's, and request
# details naming another worker), and `worker=` is in most lines a worker logs.
FENCE_LINE = "fenced: declared dead by the fleet"


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


async def steady_step(load: Load, seconds: float = 5) -> Step:
    step = Step("steady load, 3 containers")
    await load.ensure_spread()
    start = now()
    await asyncio.sleep(seconds)
    step.answers = window(load, start, now())
    bad = [a for a in step.answers if a.cls != "ok"]
    step.others_errors = len(bad)
    check(not bad, f"steady load: errors {[(a.cls, a.status, a.reason, a.edge) for a in bad[:5]]}")
    edges = {a.edge for a in step.answers}
    check(set(GATEWAYS) <= edges, f"steady load reached only {edges}")
    forwarded = sum(1 for a in step.answers if a.session and a.owner_worker
                    and a.edge != a.session.owner)
    step.notes.append(f"{forwarded} of {len(step.answers)} requests crossed containers")
    return step


async def kill_step(fleet: Fleet, load: Load, workers: Workers, victim: str) -> Step:
    step = Step(f"docker kill {victim}")
    await load.ensure_spread()
    await asyncio.sleep(1)
    start = now()
    victims = load.live_on(victim)
    container = await fleet.container(victim)
    issued = now()
    await sh("docker", "kill", container)
    fault = Fault(victim, victims, issued, now())
    log(f"killed {victim} ({len(victims)} sessions on it)")
    await wait_all_ended(victims, f"every session of killed {victim} told it is gone")
    await asyncio.sleep(1)
    judge_fault(step, load, fault, start, now())
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
    before = {w for w, host in (await workers.refresh()).items() if host == victim}
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
    fault = Fault(victim, victims, issued, now())
    log(f"paused {victim} ({len(victims)} sessions on it)")
    await asyncio.sleep(2 * LEASE_S + 1)
    # While it is frozen, its sessions are answered by the other containers only, and
    # only truthfully.
    while_frozen = [a for s in victims for a in s.answers if a.sent >= fault.effective]
    lies = untruthful(while_frozen, victim, fault.effective)
    check(not lies, f"{step.name}: answers while frozen: "
          f"{[(a.cls, a.status, a.reason, a.edge) for a in lies[:5]]}")
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
    step.notes.append(f"{len(while_frozen)} answers to its sessions while frozen; on waking, "
                      f"{sorted(dead)} found themselves declared dead and fenced; {victim} now "
                      f"runs {sorted(now_running - before)} (new) {sorted(now_running & before)} (resumed)")
    await asyncio.sleep(1)
    judge_fault(step, load, fault, start, now(), resumed=resumed, held_until=woke)
    await fleet.wait_healthy(victim)
    return step


async def disconnect_step(fleet: Fleet, load: Load, workers: Workers, victim: str) -> Step:
    step = Step(f"network disconnect {victim}")
    await load.ensure_spread()
    await asyncio.sleep(1)
    start = now()
    victims = load.live_on(victim)
    before = {w for w, host in (await workers.refresh()).items() if host == victim}
    container = await fleet.container(victim)
    network = await fleet.network()
    issued = now()
    await sh("docker", "network", "disconnect", network, container)
    fault = Fault(victim, victims, issued, now())
    log(f"cut {victim} off the network ({len(victims)} sessions on it)")
    # Cut off, it can answer nobody: every session of it is told something truthful
    # by the others, at the latest when its lease expires.
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
    judge_fault(step, load, fault, start, now(), resumed=resumed, held_until=back)
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
    check(not any(s.ended for s in live), "rotation: a session was lost")
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
    head = ["step", "requests", *shown, "others' errors", "first truthful", "time"]
    rows = []
    for s in steps:
        counts = s.counts()
        rows.append([s.name, str(len(s.answers)), *[str(counts[c]) for c in shown],
                     str(s.others_errors),
                     f"{s.first_truthful_s:.2f} s" if s.first_truthful_s is not None else "-",
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


def check_sessions(load: Load) -> str:
    """Every session was served by one owner, and its counter moved by exactly one per
    request it was told succeeded (a request with an unknown outcome may have moved it)."""
    checked = 0
    for s in load.sessions:
        last = 0
        ambiguous = 0
        between: list[Answer] = []
        for a in s.answers:
            if a.cls == "ok":
                check(a.owner_worker == s.owner_worker,
                      f"session {s.sid[:8]}… owned by {s.owner_worker} was answered by {a.owner_worker}")
                seen = "; ".join(
                    f"{b.cls} {b.status} {b.reason} at {b.sent:.1f}s "
                    f"via {b.edge}: {b.message[:160]}" for b in between)
                check(a.value is not None and last + 1 <= a.value <= last + 1 + ambiguous,
                      f"session {s.sid[:8]}… owned by {s.owner} ({s.owner_worker}): counter "
                      f"went {last} -> {a.value} at {a.sent:.1f}s via {a.edge} "
                      f"with {ambiguous} requests of unknown outcome between; "
                      f"answers between: [{seen}]")
                last, ambiguous, between = a.value, 0, []
                checked += 1
            else:
                between.append(a)
                if a.cls in ("outcome_unknown", "answer_lost", "lb_error", "timeout", "transport"):
                    ambiguous += 1
    return f"{len(load.sessions)} sessions, {checked} counted answers: one owner each, no count lost or doubled"


async def save_logs(fleet: Fleet) -> None:
    """Every container's log, for reading after the fleet is gone."""
    directory = ROOT / "build" / "compose" / "logs"
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.log"):
        old.unlink()
    for service in ("certs", "redis", "upstream", *GATEWAYS, "lb"):
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

    # The victim's answers: the table's, nginx's 502 at the victim's edge, an ok sent
    # before the fault; nothing else, wherever it came from.
    def answer(cls: str, edge: str, sent: float = 10.0) -> Answer:
        return Answer(None, sent, sent + 1, cls, None, "", edge, None)

    allowed = [answer(c, "gw1") for c in TRUTHFUL] + [answer("lb_error", "gw2"), answer("ok", "gw1", 4.0)]
    check(untruthful(allowed, "gw2", 5.0) == [], "self-test victim answers: the table's answers refused")
    for bad in (answer("not_found", "gw1"), answer("not_found", "gw2"), answer("lb_error", "gw1"),
                answer("ok", "gw1"), answer("other", "gw2"), answer("timeout", "gw3")):
        check(untruthful(allowed + [bad], "gw2", 5.0) == [bad],
              f"self-test victim answers: {bad.cls} via {bad.edge} accepted")
    print("  ok: victim answers: not_found, lb_error elsewhere, ok after the fault, other, timeout refused")
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
        for run in (lambda: steady_step(load),
                    lambda: kill_step(fleet, load, workers, "gw1"),
                    lambda: pause_step(fleet, load, workers, "gw2"),
                    lambda: disconnect_step(fleet, load, workers, "gw3"),
                    lambda: rotation_step(fleet, load)):
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
    log(check_sessions(load))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(self_test() if sys.argv[1:] == ["--self-test"] else main()))
    except TestFailure as e:
        log(f"FAILED: {e}")
        sys.exit(1)
