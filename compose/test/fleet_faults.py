"""`make compose-test`: the compose fleet, driven from outside, under the faults a
fleet of hosts meets.

Started by scripts/compose-test.sh, which builds the images, names a unique compose
project, and tears everything down afterwards whatever happens here. This driver:

1. brings the fleet up (compose/docker-compose.yml, 3 gateway containers x 2 workers,
   leases of 3 s) on a free /24 and a free host port for the load balancer;
2. runs the official MCP Python SDK client in legacy mode through nginx:
   counter_increment counts 1, 2, 3, ... while its requests land on different
   containers, and slow_stream's progress arrives before its result through a forward;
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
reached a live owner and its answer was lost; the session goes on); `not_found`; `lb_error` (nginx's own 502: the gateway process that held the
connection died, the one answer no gateway can give); `timeout`; `transport`; `other`.
The first three are the truthful answers of the README's table.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import random
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx2
import mcp
from mcp.client.streamable_http import streamable_http_client

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose" / "docker-compose.yml"
COMPOSE = os.environ.get("MCPGW_COMPOSE", "docker-compose").split()
PROJECT = os.environ["MCPGW_COMPOSE_PROJECT"]
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
# How long a worker may take to pick up rotated certificate files (watch, with a
# periodic check as the fallback).
ROTATE_WAIT_S = float(os.environ.get("MCPGW_TEST_ROTATE_WAIT_S", "5"))
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

    async def leases(self) -> dict[str, str]:
        """Worker id -> container (the host its lease names) for every live lease."""
        keys = (await self.redis("--scan", "--pattern", "mcpgw:worker:*")).split()
        if not keys:
            return {}
        values = (await self.redis("MGET", *keys)).splitlines()
        leases = {}
        for key, value in zip(keys, values):
            try:
                leases[key.removeprefix("mcpgw:worker:")] = json.loads(value)["host"]
            except (ValueError, KeyError, TypeError):
                pass  # expired between SCAN and MGET
        return leases

    async def logs(self, service: str) -> str:
        """The container's output, stdout and stderr (where the gateways log)."""
        process = await asyncio.create_subprocess_exec(
            "docker", "logs", "-t", await self.container(service),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await process.communicate()
        return out.decode(errors="replace")


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
                self.tasks.append(asyncio.create_task(self.drive(session)))
                await asyncio.sleep(0)
            else:
                await self.close_session(session)
        counts = {g: len(self.live_on(g)) for g in GATEWAYS}
        raise TestFailure(f"could not spread sessions over every container: {counts}")

    async def stop(self) -> None:
        self.running = False
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.client.aclose()


# --- Steps -----------------------------------------------------------------------------


@dataclass
class Step:
    name: str
    answers: list[Answer] = field(default_factory=list)
    first_truthful_s: float | None = None
    others_errors: int = 0
    notes: list[str] = field(default_factory=list)
    skipped: str | None = None
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
    # A request whose connection was at the victim's own edge when it died or froze gets
    # nginx's 502 or waits; everywhere else the victim's sessions get truthful answers.
    allowed = TRUTHFUL + ("not_found",)
    untruthful = [a for a in after if a.cls not in allowed and a.edge != victim
                  and not (a.cls == "ok" and a.sent < fault.effective)]
    check(not untruthful, f"{step.name}: victim sessions got untruthful answers: "
          f"{[(a.cls, a.status, a.reason, a.edge, a.message) for a in untruthful[:5]]}")
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
    not_found = [a for a in after if a.cls == "not_found"]
    if not_found:
        step.notes.append(f"NOTE: {len(not_found)} answers for its sessions said session_not_found "
                          f"(\"{not_found[0].message[:60]}…\") where the README's table says "
                          f"session_gone; a client re-initializes either way")
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


async def rejoined(fleet: Fleet, workers: Workers, victim: str, dead: set[str]) -> set[str]:
    """Waits until the victim's workers that were declared dead have fenced themselves
    (each logs it) and the container runs a full set of workers again; returns the ids
    it runs now that it did not run before."""
    deadline = time.monotonic() + 30
    while True:
        leases = await workers.refresh()
        mine = {w for w, host in leases.items() if host == victim}
        logs = await fleet.logs(victim)
        fenced = {w for w in dead if f"declared dead" in logs and f"worker={w}" in logs}
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


async def pause_step(fleet: Fleet, load: Load, workers: Workers, victim: str,
                     attempt: int = 1) -> Step:
    step = Step(f"docker pause {victim} {2 * LEASE_S + 1:.0f} s")
    await load.ensure_spread()
    await asyncio.sleep(1)
    start = now()
    victims = load.live_on(victim)
    before = {w for w, host in (await workers.refresh()).items() if host == victim}
    container = await fleet.container(victim)
    for attempt in range(1, 6):
        issued = now()
        try:
            await sh("docker", "pause", container)
            break
        except TestFailure as e:
            # The cgroup v1 freezer gives up when a process forks while it freezes;
            # runc thaws the container again, and a second try finds it quiet.
            if "unable to freeze" not in str(e) or attempt == 5:
                raise
            log(f"docker pause {victim}: the freezer gave up (attempt {attempt}); trying again")
            await asyncio.sleep(0.5)
    fault = Fault(victim, victims, issued, now())
    log(f"paused {victim} ({len(victims)} sessions on it)")
    await asyncio.sleep(2 * LEASE_S + 1)
    # While it is frozen, its sessions are answered by the other containers only, and
    # only truthfully.
    while_frozen = [a for s in victims for a in s.answers if a.sent >= fault.effective]
    check(all(a.cls in TRUTHFUL + ("not_found",) for a in while_frozen),
          f"{step.name}: answers while frozen: {[(a.cls, a.status, a.reason) for a in while_frozen[:5]]}")
    await sh("docker", "unpause", container)
    woke = now()
    log(f"unpaused {victim}")
    resumed, dead = await settle(workers, fault, woke)
    if not dead or not while_frozen:
        # Every session of it happened to have its request waiting at the frozen
        # container itself, so no other worker had reason to declare it dead: it
        # rightly resumed, and fencing was not exercised. Freeze it once more.
        check(attempt == 1, f"{step.name}: twice, no worker of {victim} was declared dead while frozen")
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


async def rotation_step(fleet: Fleet, load: Load) -> Step:
    step = Step("certificate rotation")
    status, _ = await sh("docker", "run", "--rm", "--entrypoint", "mcpgw", IMAGE,
                         "certs", "rotate", "--help", check_status=False)
    if status != 0:
        step.skipped = "SKIPPED: mcpgw certs rotate not available in this build"
        return step
    await load.ensure_spread()
    start = now()
    live = [s for s in load.sessions if not s.ended]
    reloads_before = {g: (await fleet.logs(g)).count("mesh TLS material reloaded") for g in GATEWAYS}
    for stage in ("begin", "reissue", "finish"):
        _, out = await fleet.compose("run", "--rm", "--no-deps", "-T", "certs", "rotate", stage)
        log(f"certs rotate {stage}: {out.strip().splitlines()[-1] if out.strip() else 'done'}")
        # New material is taken at once; connections made with the old one are
        # replaced within a maximum age, and must not fail a request meanwhile.
        await asyncio.sleep(max(ROTATE_WAIT_S, MAX_CONNECTION_AGE_S * 1.5))
    # Every worker took each stage's files: the bundle twice, its leaf once at least.
    for g in GATEWAYS:
        reloads = (await fleet.logs(g)).count("mesh TLS material reloaded") - reloads_before[g]
        step.notes.append(f"{g}: {reloads} reloads")
        check(reloads >= 3 * 2, f"rotation: {g}'s two workers reloaded {reloads} times, expected 3 each")
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
        values = [text_of(await client.call_tool("counter_increment", {})) for _ in range(12)]
        check(values == [str(i) for i in range(1, 13)], f"SDK counter counted {values}")
        await workers.refresh()
        calls = [(edge, owner) for name, edge, owner, _ in seen if name == "counter_increment"]
        edges = sorted({workers.container(edge) or edge for edge, _ in calls})
        owners = {owner for _, owner in calls}
        check(len(owners) == 1, f"one session answered by several owners: {owners}")
        check(len(edges) >= 2, f"the counter's requests all landed on {edges}")
        step.notes.append(f"counter_increment 1..12 in one session; requests landed on "
                          f"{', '.join(edges)}; owner {owners.pop()}")
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
    shown = [c for c in CLASSES if c in ALWAYS_SHOWN
             or any(s.counts()[c] for s in steps if not s.skipped)]
    head = ["step", "requests", *shown, "others' errors", "first truthful", "time"]
    rows = []
    for s in steps:
        if s.skipped:
            rows.append([s.name, s.skipped] + [""] * (len(head) - 2))
            continue
        counts = s.counts()
        rows.append([s.name, str(len(s.answers)), *[str(counts[c]) for c in shown],
                     str(s.others_errors),
                     f"{s.first_truthful_s:.2f} s" if s.first_truthful_s is not None else "-",
                     f"{s.seconds:.0f} s"])
    counted = [r for r in rows if not r[1].startswith("SKIPPED")]
    widths = [max(len(head[i]), *(len(r[i]) for r in counted)) for i in range(len(head))]
    print()
    print("  ".join(h.ljust(widths[i]) if i == 0 else h.rjust(widths[i]) for i, h in enumerate(head)))
    for r in rows:
        if r[1].startswith("SKIPPED"):
            print(r[0].ljust(widths[0]) + "  " + r[1])
            continue
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


# --- Main ------------------------------------------------------------------------------


async def main() -> int:
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
            step = await run()
            step.seconds = now() - started
            steps.append(step)
            log(f"{step.name}: {step.skipped or 'passed'} ({step.seconds:.0f} s)")
    except TestFailure as e:
        failure = e
    finally:
        refresher.cancel()
        await load.stop()
    print_table(steps)
    await save_logs(fleet)
    if failure is not None:
        log(f"FAILED: {failure}")
        return 1
    log(check_sessions(load))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main()))
    except TestFailure as e:
        log(f"FAILED: {e}")
        sys.exit(1)
