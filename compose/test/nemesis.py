"""`make nemesis`: the compose fleet under a seeded random schedule of faults, clients
that record everything, and a checker of the whole history (issue #43, first version).

Started by scripts/nemesis.sh (images, a unique compose project, teardown on any exit).
This driver:

1. prints the seed and the whole schedule first (`NEMESIS_SEED`, default random;
   `NEMESIS_SECONDS`, default 300; `NEMESIS_FAULTS` caps the number of faults): the
   same seed gives the same faults, in the same order, on the same targets, with the
   same holds;
2. brings the fleet up as `make compose-test` does (fleet_faults.py: 3 gateway
   containers x 2 workers, 3 s leases, nginx round-robin in front);
3. runs NEMESIS_SLOTS (default 15) client slots, each a legacy session calling
   counter_increment in a loop with raw HTTP; every request gets a JSON-RPC id unique
   in the run, and every request and its answer (status, class, reason, counter
   value, the mcpgw-* headers, times) is appended to a history file (JSON lines); a
   session told gone is replaced by a new one, as clients are told to do;
4. meanwhile injects the faults: kill -9 of one worker process inside a container,
   `docker kill` of a container and `docker start` after a random delay, `docker
   pause` for a random time below the lease and above it, `docker network disconnect`
   and reconnect after a random delay. At most two faults at once, never two on one
   container, at most one container down (killed, paused or cut off) at a time, so the
   fleet can serve. A planned fault whose slot is taken waits until it is free (the
   log says how long);
5. after the last fault, lets the load settle, then reads the upstream's `GET
   /executed` (which ids ran in which upstream session, in order) and every fencing
   line of the gateways' logs, and runs the checker on the files it wrote.

The checker (`--check HISTORY EXECUTED`, also run on its own) fails on:

- a counter that restarts (a value at or below one seen before in the session)
  without a truthful loss told before it (session_gone, session_not_found,
  member_lost; an outcome_unknown says one request may have run, not that the state
  is gone, so it excuses no restart); a value seen twice;
- a gap: a counter that moved by more than one per call told it succeeded, beyond the
  calls whose outcome is unknown or that got no answer (502 outcome_unknown, nginx's
  own 502, a timeout, a transport error);
- a 200 for a call without a counter value;
- against the upstream's record: an id that ran twice; a request answered "did not
  run" (a retryable 503, gone, not found, any other refusal) that ran; a counter value
  told for an id that never ran, or that is not the id's place among the run's ids of
  its upstream session; one client session's calls run in two upstream sessions, or
  two client sessions' calls in one;
- two owners: an ok answer from a worker other than the session's owner without an
  answer saying it adopted the session (`mcpgw-adopted`), or from an earlier owner
  after an adoption; an ok answer from a worker after it was killed (the nemesis knows
  whom it killed) or after it logged that it fenced itself (gateway logs);
- a client slot that was not served again (no ok call) in the settle time at the end.

It prints, per fault class, the faults, requests, answers 200, retryable errors,
truthful losses, unanswered requests, anomalies (must be 0) and the longest time a
client slot could not be served, and lists every anomaly. A request counts for each
fault in effect when it was sent (from the fault until its container is whole again,
plus two leases for the adoptions that follow); the others for `quiet`.

`--self-test` feeds the checker a clean history (it must pass) and one history with
each anomaly (each must fail, naming it). `--plan` prints the schedule of a seed.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fleet_faults as ff  # noqa: E402  (the fleet, its load's HTTP and classification)

ROOT = ff.ROOT
OUT = ROOT / "build" / "nemesis"
LEASE_S = ff.LEASE_S
GATEWAYS = ff.GATEWAYS
SLOTS = int(os.environ.get("NEMESIS_SLOTS", "15"))
THINK_S = ff.THINK_S
RETRY_S = ff.RETRY_S
# After the last fault: time for its victims' adoptions, then every slot must be served.
SETTLE_S = 3 * LEASE_S + 6
# A fault's aftermath (adoption of its victims) counts for it this long after it healed.
AFTERMATH_S = 2 * LEASE_S
# Our JSON-RPC ids start here, so any id the gateway sends on its own is told apart.
FIRST_ID = 1_000_000_000

# Fault classes, the weight of each in the schedule, and whether it takes a whole
# container down (at most one such at a time).
FAULTS = {
    "worker_kill": (3, False),       # kill -9 of one worker process in a container
    "container_kill": (2, True),     # docker kill, docker start after `hold`
    "pause_short": (1.5, True),      # docker pause for `hold` < lease
    "pause_long": (1.5, True),       # docker pause for `hold` > lease
    "disconnect": (2, True),         # docker network disconnect, connect after `hold`
}

# What an answer says about whether its call ran (docs/clients.md), as
# tests/src/load.rs judges it: no answer, or one that says so, may hide a run.
MAY_HAVE_RUN = ("outcome_unknown", "answer_lost", "lb_error", "timeout", "transport")
AMBIGUOUS_REASONS = ("outcome_unknown", "upstream_timeout", "upstream_failed")
# Answers after which a client may meet a fresh counter: the state is gone.
TRUTHFUL_LOSS_REASONS = ("session_gone", "session_not_found", "member_lost")
LOSS_CLASSES = ("gone", "not_found", "outcome_unknown", "answer_lost")


def may_have_run(r: dict) -> bool:
    return (r["cls"] in MAY_HAVE_RUN or r.get("reason") in AMBIGUOUS_REASONS
            # Not a gateway's answer (no mcpgw header, no JSON-RPC body): nobody said.
            or (r["cls"] == "other" and not r.get("edge_worker") and r.get("status") != 200))


def truthful_loss(r: dict) -> bool:
    return r["cls"] in ("gone", "not_found") or r.get("reason") in TRUTHFUL_LOSS_REASONS


# --- The schedule ----------------------------------------------------------------------


@dataclass
class Planned:
    n: int
    at: float          # seconds after the load started
    cls: str
    target: str        # container
    rank: int          # worker_kill: which of the container's workers (by id order)
    hold: float        # seconds until restart / unpause / reconnect


def plan(seed: int, seconds: float, max_faults: int | None = None) -> list[Planned]:
    """The whole schedule of a seed: a fault every 3-12 s, class by weight, any
    container, holds drawn per class (pauses below and above the lease)."""
    rng = random.Random(seed)
    names = list(FAULTS)
    weights = [FAULTS[n][0] for n in names]
    planned, at = [], rng.uniform(4, 8)
    while at < seconds and (max_faults is None or len(planned) < max_faults):
        cls = rng.choices(names, weights)[0]
        target = rng.choice(GATEWAYS)
        rank = rng.randrange(2)
        hold = {"worker_kill": 0.0,
                "container_kill": rng.uniform(1, 8),
                "pause_short": rng.uniform(0.3, 0.8) * LEASE_S,
                "pause_long": rng.uniform(1.5, 3) * LEASE_S,
                "disconnect": rng.uniform(0.5, 2.5) * LEASE_S}[cls]
        planned.append(Planned(len(planned) + 1, round(at, 2), cls, target, rank, round(hold, 2)))
        at += rng.uniform(3, 12)
    return planned


def print_plan(seed: int, seconds: float, planned: list[Planned]) -> None:
    print(f"nemesis: seed {seed}, {seconds:g} s, {len(planned)} faults planned "
          f"(replay: NEMESIS_SEED={seed} NEMESIS_SECONDS={seconds:g} make nemesis)", flush=True)
    for p in planned:
        what = {"worker_kill": f"kill -9 worker #{p.rank} of {p.target}",
                "container_kill": f"docker kill {p.target}, start after {p.hold:.1f} s",
                "pause_short": f"docker pause {p.target} {p.hold:.1f} s (< lease)",
                "pause_long": f"docker pause {p.target} {p.hold:.1f} s (> lease)",
                "disconnect": f"disconnect {p.target} {p.hold:.1f} s"}[p.cls]
        print(f"  #{p.n:<3} at {p.at:6.1f} s  {p.cls:<15} {what}", flush=True)


def may_start(p: Planned, active: list[Planned]) -> bool:
    """At most two at once, never two on one container, one container down at most."""
    return (len(active) < 2 and all(a.target != p.target for a in active)
            and not (FAULTS[p.cls][1] and any(FAULTS[a.cls][1] for a in active)))


# --- Recording -------------------------------------------------------------------------


class History:
    """The run's history, one JSON object a line, written as it happens."""

    def __init__(self, path: Path):
        self.path = path
        self.file = path.open("w")
        self.ids = itertools.count(FIRST_ID)

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self.file.flush()  # a run cut short by `timeout` keeps what it saw

    def close(self) -> None:
        self.file.close()


def request_record(slot: int, op: str, rid: int | None, answer: ff.Answer, sid: str | None) -> dict:
    return {"type": "request", "slot": slot, "session": sid, "op": op, "id": rid,
            "sent": round(answer.sent, 4), "done": round(answer.done, 4), "cls": answer.cls,
            "status": answer.status, "reason": answer.reason, "value": answer.value,
            "edge": answer.edge, "edge_worker": answer.edge_worker,
            "owner_worker": answer.owner_worker, "adopted": answer.adopted,
            "message": answer.message[:200]}


class Clients:
    """Client slots through nginx: each a session calling counter_increment until it is
    told gone, then a new one. Every request goes to the history."""

    def __init__(self, fleet: ff.Fleet, workers: ff.Workers, history: History):
        self.load = ff.Load(fleet, workers)  # its HTTP client and answer classification
        self.history = history
        self.running = True
        self.tasks: list[asyncio.Task] = []

    async def post(self, slot: int, op: str, body: dict, session: ff.LoadSession | None,
                   ) -> tuple[ff.Answer, object]:
        answer, response = await self.load.post(body, session)
        sid = session.sid if session else None
        self.history.write(request_record(slot, op, body.get("id"), answer, sid))
        return answer, response

    async def open_session(self, slot: int) -> ff.LoadSession | None:
        init = {"jsonrpc": "2.0", "id": next(self.history.ids), "method": "initialize",
                "params": {"protocolVersion": ff.PROTOCOL, "capabilities": {},
                           "clientInfo": {"name": "mcpgw-nemesis", "version": "0"}}}
        answer, response = await self.post(slot, "init", init, None)
        if answer.cls != "ok" or response is None or "mcp-session-id" not in response.headers:
            return None
        session = ff.LoadSession(response.headers["mcp-session-id"],
                                 response.headers.get("mcpgw-owner-worker", ""), "?", answer.done)
        self.history.write({"type": "session", "slot": slot, "session": session.sid,
                            "owner_worker": session.owner_worker, "at": round(answer.done, 4)})
        note, _ = await self.post(slot, "notify", {"jsonrpc": "2.0", "method": "notifications/initialized"},
                                  session)
        return session if note.cls == "ok" else None

    async def drive(self, slot: int) -> None:
        session = None
        while self.running:
            if session is None:
                session = await self.open_session(slot)
                if session is None:
                    await asyncio.sleep(0.5)
                continue
            body = {"jsonrpc": "2.0", "id": next(self.history.ids), "method": "tools/call",
                    "params": {"name": "counter_increment", "arguments": {}}}
            answer, _ = await self.post(slot, "call", body, session)
            if truthful_loss({"cls": answer.cls, "reason": answer.reason}):
                session = None
            else:
                await asyncio.sleep(RETRY_S if answer.cls == "unknown" else THINK_S)

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self.drive(i)) for i in range(SLOTS)]

    async def stop(self) -> None:
        self.running = False
        results = await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.load.client.aclose()
        crashed = [r for r in results if isinstance(r, BaseException)]
        ff.check(not crashed, f"{len(crashed)} client slots crashed: {crashed[:3]!r}")


# --- Faults ----------------------------------------------------------------------------


async def container_workers(workers: ff.Workers, target: str) -> list[str]:
    return sorted(w for w, host in (await workers.refresh()).items() if host == target)


async def wait_whole(fleet: ff.Fleet, workers: ff.Workers, target: str, gone: set[str]) -> None:
    """Until `target` runs two leased workers none of which is in `gone`, and is ready."""
    deadline = time.monotonic() + 90
    while True:
        mine = set(await container_workers(workers, target))
        if len(mine - gone) >= 2 and not mine & gone:
            await fleet.wait_ready(target, within=max(5.0, deadline - time.monotonic()))
            return
        ff.check(time.monotonic() < deadline, f"{target} did not run two fresh workers within 90 s "
                 f"(leases {sorted(mine)}, gone {sorted(gone)})")
        await asyncio.sleep(0.3)


async def inject(fleet: ff.Fleet, workers: ff.Workers, p: Planned, history: History) -> None:
    """Makes one fault, holds it, heals it, waits until its container is whole; writes
    its record (times in run seconds)."""
    record = {"type": "fault", **asdict(p), "start": round(ff.now(), 4)}
    container = await fleet.container(p.target)
    before = set(await container_workers(workers, p.target))
    dead: list[str] = []
    try:
        if p.cls == "worker_kill":
            mine = sorted(before)
            ff.check(bool(mine), f"{p.target} has no leased worker to kill")
            victim = mine[p.rank % len(mine)]
            pid = victim.rsplit("-", 2)[-2]  # worker ids are host-pid-random
            record["worker"] = victim
            await ff.sh("docker", "exec", container, "bash", "-c", f"kill -9 {int(pid)}")
            dead = [victim]
            record["effective"] = round(ff.now(), 4)
            await wait_whole(fleet, workers, p.target, set(dead))
        elif p.cls == "container_kill":
            await ff.sh("docker", "kill", container)
            dead = sorted(before)
            record["effective"] = round(ff.now(), 4)
            await asyncio.sleep(p.hold)
            await ff.sh("docker", "start", container)
            record["healing"] = round(ff.now(), 4)
            await wait_whole(fleet, workers, p.target, set(dead))
        elif p.cls in ("pause_short", "pause_long"):
            for attempt in range(1, 6):
                try:
                    await ff.sh("docker", "pause", container)
                    break
                except ff.TestFailure as e:
                    # The cgroup v1 freezer gives up when a process forks while it
                    # freezes; runc thaws the container, and a second try finds it quiet.
                    if "unable to freeze" not in str(e) or attempt == 5:
                        raise
                    await asyncio.sleep(0.3)
            record["effective"] = round(ff.now(), 4)
            await asyncio.sleep(p.hold)
            await ff.sh("docker", "unpause", container)
            record["healing"] = round(ff.now(), 4)
            # Its workers that were declared dead find out and fence themselves within
            # a lease; only then is it whole (a fresh worker in each slot that fenced).
            await asyncio.sleep(LEASE_S)
            await wait_whole(fleet, workers, p.target, set())
        elif p.cls == "disconnect":
            network = await fleet.network()
            await ff.sh("docker", "network", "disconnect", network, container)
            record["effective"] = round(ff.now(), 4)
            await asyncio.sleep(p.hold)
            await ff.sh("docker", "network", "connect", "--ip", fleet.ip[p.target], "--alias",
                        p.target, network, container)
            record["healing"] = round(ff.now(), 4)
            await asyncio.sleep(LEASE_S)
            await wait_whole(fleet, workers, p.target, set())
    except ff.TestFailure as e:
        record["error"] = str(e)[:500]
        ff.log(f"fault #{p.n} {p.cls} {p.target}: HARNESS ERROR: {e}")
    record["dead_workers"] = dead
    record["healed"] = round(ff.now(), 4)
    history.write(record)
    ff.log(f"fault #{p.n} {p.cls} {p.target} healed after {record['healed'] - record['start']:.1f} s"
           + (f" (killed {dead})" if dead else ""))


async def run_schedule(fleet: ff.Fleet, workers: ff.Workers, planned: list[Planned],
                       history: History, seconds: float, load_started: float) -> None:
    """Starts each planned fault at its time, or once its slot is free (in order)."""
    active: dict[asyncio.Task, Planned] = {}
    for p in planned:
        await asyncio.sleep(max(0.0, load_started + p.at - ff.now()))
        while not may_start(p, list(active.values())):
            done, _ = await asyncio.wait(active, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                active.pop(t)
        late = ff.now() - load_started - p.at
        if ff.now() - load_started > seconds:
            ff.log(f"fault #{p.n} {p.cls} {p.target}: not started, the run's {seconds:g} s are over")
            history.write({"type": "skipped", **asdict(p)})
            continue
        ff.log(f"fault #{p.n} {p.cls} {p.target}" + (f" hold {p.hold:.1f} s" if p.hold else "")
               + (f" (waited {late:.1f} s for its slot)" if late > 0.5 else "")
               + (f", while {[(a.cls, a.target) for a in active.values()]}" if active else ""))
        active[asyncio.create_task(inject(fleet, workers, p, history))] = p
    if active:
        await asyncio.wait(active)


# --- Reading the upstream and the logs ---------------------------------------------------


async def read_executed(fleet: ff.Fleet) -> dict:
    """The upstream's `GET /executed`, read from inside its container."""
    script = ('exec 3<>/dev/tcp/127.0.0.1/9000 && printf "GET /executed HTTP/1.0\\r\\n'
              'Host: 127.0.0.1\\r\\n\\r\\n" >&3 && cat <&3')
    _, out = await ff.sh("docker", "exec", await fleet.container("upstream"), "bash", "-c", script,
                         timeout=60)
    body = out.partition("\r\n\r\n")[2]
    executed = json.loads(body)
    ff.check(isinstance(executed, dict) and "sessions" in executed,
             f"the upstream's /executed is not what it should be: {body[:200]!r}")
    return executed


def fence_times(log_text: str, wall0: float) -> list[dict]:
    """Each fencing line (`docker logs -t`) as {worker, at (run seconds)}."""
    fences = []
    for line in log_text.splitlines():
        if ff.FENCE_LINE not in line:
            continue
        stamp = line.split(" ", 1)[0]
        try:
            date, _, frac = stamp.rstrip("Z").partition(".")
            wall = datetime.datetime.fromisoformat(date).replace(
                tzinfo=datetime.timezone.utc).timestamp() + float(f"0.{frac or 0}")
        except ValueError:
            continue
        for token in line.split():
            if token.startswith("worker="):
                fences.append({"type": "fence", "worker": token.removeprefix("worker=").strip('"'),
                               "at": round(wall - wall0, 4)})
    return fences


# --- The checker -----------------------------------------------------------------------


@dataclass
class Anomaly:
    kind: str
    slot: int | None
    session: str | None
    at: float
    detail: str


@dataclass
class Verdict:
    anomalies: list[Anomaly] = field(default_factory=list)
    table: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Each session told it is gone (truthful, so no anomaly; but here every session
    # could go on, since the demo upstream keeps its state and every gateway can adopt).
    lost: list[str] = field(default_factory=list)


def describe(r: dict) -> str:
    return (f"#{r['id']} {r['cls']} {r.get('status')} {r.get('reason') or ''} value={r.get('value')} "
            f"sent {r['sent']:.2f}s edge {r.get('edge')}/{r.get('edge_worker')} "
            f"owner {r.get('owner_worker')} adopted {r.get('adopted')}").replace("  ", " ")


def check_history(records: list[dict], executed: dict) -> Verdict:
    """Every check of the module docstring on a run's history and the upstream's record."""
    verdict = Verdict()
    anomalies = verdict.anomalies
    requests = [r for r in records if r.get("type") == "request"]
    faults = [r for r in records if r.get("type") == "fault"]
    fences = {r["worker"]: r["at"] for r in records if r.get("type") == "fence"}
    run = next((r for r in records if r.get("type") == "run"), {})
    end = next((r for r in records if r.get("type") == "end"), {})

    def flag(kind: str, r: dict | None, detail: str, at: float | None = None) -> None:
        anomalies.append(Anomaly(kind, r and r.get("slot"), r and r.get("session"),
                                 at if at is not None else (r["sent"] if r else 0.0), detail))

    # Who may not answer from when: killed workers from their kill, fenced ones from
    # their fencing line.
    dead_from: dict[str, float] = {}
    for f in faults:
        for w in f.get("dead_workers", []):
            dead_from[w] = min(dead_from.get(w, f["effective"]), f["effective"])
    for w, at in fences.items():
        dead_from[w] = min(dead_from.get(w, at), at)

    # Per client session, in order: counters, owners.
    by_session: dict[str, list[dict]] = {}
    for r in requests:
        if r["op"] == "call" and r["session"]:
            by_session.setdefault(r["session"], []).append(r)
    opened_by = {r["session"]: r["owner_worker"] for r in records if r.get("type") == "session"}
    for sid, calls in by_session.items():
        calls.sort(key=lambda r: r["sent"])
        last, seen, unaccounted, lost = 0, set(), 0, False
        owner, earlier = opened_by.get(sid), []
        for r in calls:
            if r["cls"] == "ok":
                v = r.get("value")
                if not isinstance(v, int):
                    flag("no_counter", r, f"a 200 without a counter value: {describe(r)}")
                    continue
                if lost and v == 1:
                    last, seen, unaccounted = 0, set(), 0  # a fresh state, told truthfully
                if v <= last and (v == 1 or v not in seen):
                    flag("counter_restart", r, f"counter went {last} -> {v} with no truthful loss "
                         f"told before it: {describe(r)}")
                elif v in seen:
                    flag("value_seen_twice", r, f"counter value {v} was already seen in this session "
                         f"(last {last}): {describe(r)}")
                elif v <= last:
                    flag("counter_restart", r, f"counter went {last} -> {v} with no truthful loss "
                         f"told before it: {describe(r)}")
                elif v > last + 1 + unaccounted:
                    flag("gap", r, f"counter went {last} -> {v} with only {unaccounted} calls of "
                         f"unknown outcome between: {describe(r)}")
                else:
                    unaccounted -= v - last - 1
                seen.add(v)
                last, lost = max(last, v), False
                # Owners: one at a time, a new one only where an answer says it adopted.
                w = r.get("owner_worker")
                if r.get("adopted"):
                    if not w or w == owner or w in earlier:
                        flag("two_owners", r, f"adopted by {w}, not a new owner (owner {owner}, "
                             f"earlier {earlier}): {describe(r)}")
                    else:
                        earlier.append(owner)
                        owner = w
                elif not owner:
                    owner = w
                elif w != owner:
                    flag("two_owners", r, f"owned by {owner} but served by {w} "
                         + ("(its owner before an adoption)" if w in earlier
                            else "(no answer said it adopted the session)") + f": {describe(r)}")
                if w in dead_from and r["sent"] > dead_from[w]:
                    flag("served_by_dead", r, f"{w} answered a request sent {r['sent'] - dead_from[w]:.2f} s "
                         f"after it was killed or fenced: {describe(r)}")
            else:
                if may_have_run(r):
                    unaccounted += 1
                if truthful_loss(r):
                    lost = True

    # Against the upstream's record.
    if executed.get("dropped"):
        flag("executed_incomplete", None, f"the upstream's log left out {executed['dropped']} runs: "
             f"what ran cannot be told in full", at=0.0)
    ran: dict[int, list[tuple[str, int]]] = {}  # id -> [(upstream session, place among ours)]
    foreign = 0
    for upstream_sid, ids in (executed.get("sessions") or {}).items():
        place = 0
        for rid in ids:
            if isinstance(rid, int) and rid >= FIRST_ID:
                place += 1
                ran.setdefault(rid, []).append((upstream_sid, place))
            else:
                foreign += 1
    if foreign:
        verdict.notes.append(f"{foreign} ids the upstream ran were not the clients' (left out)")
    upstream_of: dict[str, set[str]] = {}
    client_of: dict[str, set[str]] = {}
    for r in requests:
        if r["op"] != "call":
            continue
        runs = ran.get(r["id"], [])
        for upstream_sid, _ in runs:
            upstream_of.setdefault(r["session"], set()).add(upstream_sid)
            client_of.setdefault(upstream_sid, set()).add(r["session"])
        if len(runs) > 1:
            flag("ran_twice", r, f"ran {len(runs)} times upstream: {describe(r)}")
        if r["cls"] == "ok" and isinstance(r.get("value"), int):
            if not runs:
                flag("ok_never_ran", r, f"answered with a counter value, but never ran: {describe(r)}")
            elif runs[0][1] != r["value"]:
                flag("value_not_its_run", r, f"told counter {r['value']}, but it was run "
                     f"#{runs[0][1]} of its upstream session: {describe(r)}")
        elif runs and not may_have_run(r) and r["cls"] != "ok":
            flag("did_not_run_but_ran", r, f"told it did not run, but it ran upstream: {describe(r)}")
    for sid, ups in upstream_of.items():
        if len(ups) > 1:
            first = by_session[sid][0]
            flag("split_upstream", first, f"the session's calls ran in {len(ups)} upstream sessions "
                 f"(a silent new state)")
    for ups, sids in client_of.items():
        if len(sids) > 1:
            flag("shared_upstream", by_session[sorted(sids)[0]][0],
                 f"upstream session {ups[:12]}… ran calls of {len(sids)} client sessions")

    # Every slot served again at the end.
    settle_from = end.get("settle_from")
    if settle_from is not None:
        slots = {r["slot"] for r in requests}
        served = {r["slot"] for r in requests if r["op"] == "call" and r["cls"] == "ok"
                  and r["sent"] >= settle_from}
        for slot in sorted(slots - served):
            mine = [r for r in requests if r["slot"] == slot]
            flag("not_served_at_end", mine[-1], f"slot {slot} got no ok call after {settle_from:.1f} s "
                 f"(the settle time); its last answers: "
                 + "; ".join(describe(r) for r in mine[-4:]), at=settle_from)

    ws = windows(faults)
    for r in requests:
        if r["op"] == "call" and truthful_loss(r):
            verdict.lost.append(f"slot {r['slot']} session {r['session']} at {r['sent']:.2f} s "
                                f"(during {', '.join(classes_at(ws, r['sent']))}): {describe(r)}: "
                                f"{r.get('message', '')[:160]}")
    verdict.table = class_table(requests, faults, anomalies, end.get("load_end"))
    if run:
        verdict.notes.insert(0, f"seed {run.get('seed')}, {run.get('seconds')} s, "
                             f"{len(faults)} faults made")
    return verdict


def windows(faults: list[dict]) -> list[tuple[str, float, float]]:
    return [(f["cls"], f["start"], f["healed"] + AFTERMATH_S) for f in faults]


def classes_at(ws: list[tuple[str, float, float]], t: float) -> list[str]:
    hit = sorted({cls for cls, a, b in ws if a <= t < b})
    return hit or ["quiet"]


def class_table(requests: list[dict], faults: list[dict], anomalies: list[Anomaly],
                load_end: float | None) -> list[list[str]]:
    """Per fault class: faults, requests, ok, retryable, losses, unanswered, other,
    anomalies, availability, the longest time a client slot could not be served."""
    ws = windows(faults)
    names = [*FAULTS, "quiet"]
    rows = {n: {"faults": 0, "requests": 0, "ok": 0, "retryable": 0, "losses": 0,
                "unanswered": 0, "other": 0, "anomalies": 0, "outage": 0.0} for n in names}
    rows["all"] = dict(rows["quiet"])
    for f in faults:
        rows[f["cls"]]["faults"] += 1
        rows["all"]["faults"] += 1
    for r in requests:
        for name in [*classes_at(ws, r["sent"]), "all"]:
            row = rows[name]
            row["requests"] += 1
            key = ("ok" if r["cls"] == "ok" else "retryable" if r["cls"] == "unknown"
                   else "losses" if r["cls"] in LOSS_CLASSES or truthful_loss(r)
                   else "unanswered" if r["cls"] in ("lb_error", "timeout", "transport") else "other")
            row[key] += 1
    for a in anomalies:
        for name in [*classes_at(ws, a.at), "all"]:
            rows[name]["anomalies"] += 1
    # Outages: from a slot's first failed request to its next ok call.
    by_slot: dict[int, list[dict]] = {}
    for r in requests:
        by_slot.setdefault(r["slot"], []).append(r)
    for mine in by_slot.values():
        mine.sort(key=lambda r: r["sent"])
        down_since = None
        for r in mine:
            if r["cls"] == "ok" and r["op"] == "call":
                if down_since is not None:
                    for name in [*classes_at(ws, down_since), "all"]:
                        rows[name]["outage"] = max(rows[name]["outage"], r["done"] - down_since)
                down_since = None
            elif r["cls"] != "ok" and down_since is None:
                down_since = r["sent"]
        if down_since is not None and load_end is not None:
            for name in [*classes_at(ws, down_since), "all"]:
                rows[name]["outage"] = max(rows[name]["outage"], load_end - down_since)
    table = [["class", "faults", "requests", "200", "avail", "retryable", "losses", "unanswered",
              "other", "anomalies", "longest outage"]]
    for name in [*names, "all"]:
        row = rows[name]
        if not row["requests"] and not row["faults"]:
            continue
        table.append([name, str(row["faults"]), str(row["requests"]), str(row["ok"]),
                      f"{100 * row['ok'] / row['requests']:.1f}%" if row["requests"] else "-",
                      str(row["retryable"]), str(row["losses"]), str(row["unanswered"]),
                      str(row["other"]), str(row["anomalies"]), f"{row['outage']:.1f} s"])
    return table


def print_verdict(v: Verdict) -> None:
    widths = [max(len(row[i]) for row in v.table) for i in range(len(v.table[0]))]
    print()
    for row in v.table:
        print("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row)))
    print()
    for note in v.notes:
        print(f"  {note}")
    kinds: dict[str, int] = {}
    for a in v.anomalies:
        kinds[a.kind] = kinds.get(a.kind, 0) + 1
    print(f"  sessions told they are gone: {len(v.lost)} (no anomaly: the client was told; but "
          f"every session here could go on elsewhere)")
    for line in v.lost:
        print(f"  LOST {line}")
    print(f"  anomalies: {len(v.anomalies)}" + (f" ({kinds})" if kinds else ""))
    for a in v.anomalies:
        print(f"  ANOMALY {a.kind} at {a.at:.2f} s slot {a.slot} session {a.session}: {a.detail}")
    print(flush=True)


def read_files(history_path: str, executed_path: str) -> tuple[list[dict], dict]:
    records = [json.loads(line) for line in Path(history_path).read_text().splitlines() if line.strip()]
    return records, json.loads(Path(executed_path).read_text())


# --- Self-test -------------------------------------------------------------------------


def self_test() -> int:
    """The checker on a clean history (must pass) and on one with each anomaly (each
    must fail, naming it): no fleet, a fraction of a second."""
    print("self-test of the nemesis checker:")
    ids = itertools.count(FIRST_ID)

    def req(slot, sid, cls, sent, value=None, owner=None, adopted=None, status=None, reason="",
            op="call", edge_worker="gw1-1-aaaaaa"):
        status = status or {"ok": 200, "unknown": 503, "gone": 404, "not_found": 404,
                            "outcome_unknown": 502, "answer_lost": 502, "lb_error": 502}.get(cls)
        reason = reason or {"unknown": "ownership_unknown", "gone": "session_gone",
                            "not_found": "session_not_found", "outcome_unknown": "outcome_unknown",
                            "answer_lost": "outcome_unknown"}.get(cls, "")
        return {"type": "request", "slot": slot, "session": sid, "op": op, "id": next(ids),
                "sent": sent, "done": sent + 0.05, "cls": cls, "status": status, "reason": reason,
                "value": value, "edge": "gw1", "edge_worker": None if cls == "lb_error" else edge_worker,
                "owner_worker": owner if cls == "ok" else None, "adopted": adopted, "message": ""}

    # Slot 0: session A owned by gw2-2-aaa, which is killed at 3.0; its calls get a
    # retryable 503, an outcome_unknown (which ran), then the adopting answer by
    # gw3-7-bbb, and go on. Slot 1: session B told gone (it was not run), and a new
    # session C starting at 1. Slot 2: session D with an lb_error that did not run.
    a = [req(0, "A", "ok", 1.0, 1, "gw2-2-aaa"), req(0, "A", "ok", 2.0, 2, "gw2-2-aaa"),
         req(0, "A", "outcome_unknown", 3.1), req(0, "A", "unknown", 3.5),
         req(0, "A", "ok", 6.0, 4, "gw3-7-bbb", adopted="death"), req(0, "A", "ok", 7.0, 5, "gw3-7-bbb")]
    b = [req(1, "B", "ok", 1.0, 1, "gw1-3-ccc"), req(1, "B", "gone", 4.0)]
    c = [req(1, "C", "ok", 5.0, 1, "gw1-4-ddd"), req(1, "C", "ok", 7.5, 2, "gw1-4-ddd")]
    d = [req(2, "D", "ok", 1.0, 1, "gw1-3-ccc"), req(2, "D", "lb_error", 2.0),
         req(2, "D", "ok", 7.2, 2, "gw1-3-ccc")]
    sessions = [{"type": "session", "slot": s, "session": sid, "owner_worker": o, "at": 0.5}
                for s, sid, o in ((0, "A", "gw2-2-aaa"), (1, "B", "gw1-3-ccc"), (1, "C", "gw1-4-ddd"),
                                  (2, "D", "gw1-3-ccc"))]
    fault = {"type": "fault", "n": 1, "cls": "container_kill", "target": "gw2", "rank": 0, "hold": 1.0,
             "at": 3.0, "start": 3.0, "effective": 3.05, "healed": 5.0, "dead_workers": ["gw2-2-aaa", "gw2-5-eee"]}
    end = {"type": "end", "load_end": 8.0, "settle_from": 6.5}
    clean = [{"type": "run", "seed": 1, "seconds": 8}, *sessions, fault, *a, *b, *c, *d, end]

    def executed_of(history: list[dict]) -> dict:
        """What an honest upstream ran: every ok call, and the outcome_unknown of A."""
        up = {"A": "up-a", "B": "up-b", "C": "up-c", "D": "up-d"}
        runs: dict[str, list] = {}
        for r in history:
            if r.get("type") == "request" and (r["cls"] == "ok" or r["cls"] == "outcome_unknown"):
                runs.setdefault(up[r["session"]], []).append(r["id"])
        runs.setdefault("up-a", []).insert(0, 7)  # an id that is not the clients': left out
        return {"sessions": runs, "dropped": 0}

    verdict = check_history(clean, executed_of(clean))
    ff.check(not verdict.anomalies, "self-test: a clean history failed: "
             + "; ".join(f"{x.kind}: {x.detail}" for x in verdict.anomalies))
    quiet = next(row for row in verdict.table if row[0] == "container_kill")
    ff.check(quiet[1] == "1", f"self-test: the fault was not counted: {verdict.table}")
    print("  ok: a clean history (an adoption, an outcome_unknown that ran, gone then a new "
          "session, an lb_error) passes")

    def replaced(history: list[dict], index_of: dict, **changes) -> list[dict]:
        return [dict(r, **changes) if r is index_of else r for r in history]

    def expect(what: str, kind: str, history: list[dict], executed: dict | None = None) -> None:
        v = check_history(history, executed if executed is not None else executed_of(history))
        kinds = {x.kind for x in v.anomalies}
        ff.check(kind in kinds, f"self-test {what}: not found as {kind} (found {sorted(kinds) or 'nothing'})")
        print(f"  ok: {what}: {kind}")

    ok_a4 = a[4]
    # The counter restarting in one session without a truthful loss (a silent new state).
    expect("a counter restarting", "counter_restart",
           replaced(clean, a[5], value=1), executed={"sessions": {}, "dropped": 0})
    expect("a value seen twice", "value_seen_twice", replaced(clean, a[5], value=4),
           executed={"sessions": {}, "dropped": 0})
    expect("a gap without an unknown outcome", "gap", replaced(clean, a[5], value=7),
           executed={"sessions": {}, "dropped": 0})
    expect("a 200 without a counter", "no_counter", replaced(clean, a[5], value=None))
    expect("the dead owner serving after the adoption", "two_owners",
           replaced(clean, a[5], owner_worker="gw2-2-aaa"))
    expect("a new owner without an adopting answer", "two_owners", replaced(clean, ok_a4, adopted=None))
    expect("a killed worker answering", "served_by_dead",
           replaced(clean, d[2], owner_worker="gw2-5-eee"))
    fenced = [*clean, {"type": "fence", "worker": "gw1-4-ddd", "at": 6.0}]
    expect("a fenced worker answering", "served_by_dead", fenced)
    # Against the upstream.
    ex = executed_of(clean)
    ex["sessions"]["up-a"].append(a[5]["id"])
    expect("an id run twice", "ran_twice", clean, ex)
    ex = executed_of(clean)
    ex["sessions"]["up-a"].insert(3, a[3]["id"])  # the retryable 503 did run
    expect("a 'did not run' answer that ran", "did_not_run_but_ran", clean, ex)
    ex = executed_of(clean)
    ex["sessions"]["up-b"].append(b[1]["id"])  # session_gone, but it ran
    expect("a session_gone whose call ran", "did_not_run_but_ran", clean, ex)
    ex = executed_of(clean)
    ex["sessions"]["up-c"].remove(c[1]["id"])
    expect("an ok that never ran", "ok_never_ran", clean, ex)
    ex = executed_of(clean)
    ex["sessions"]["up-a"].remove(a[2]["id"])  # the counter says 4, but it is run #3
    expect("a value that is not the call's place", "value_not_its_run", clean, ex)
    ex = executed_of(clean)
    ex["sessions"]["up-a2"] = [ex["sessions"]["up-a"].pop()]
    expect("one session's calls in two upstream sessions", "split_upstream", clean, ex)
    ex = executed_of(clean)
    ex["sessions"]["up-c"] += ex["sessions"].pop("up-d")
    expect("two sessions' calls in one upstream session", "shared_upstream", clean, ex)
    expect("an incomplete upstream record", "executed_incomplete", clean, executed_of(clean) | {"dropped": 3})
    expect("a slot never served again", "not_served_at_end",
           [r for r in clean if r is not d[2]], executed={"sessions": {}, "dropped": 0})
    # A truthful loss excuses a fresh counter; outcome_unknown alone does not.
    lost = [dict(r, cls="gone", status=404, reason="session_gone", value=None) if r is a[3] else
            dict(r, value={4: 1, 5: 2}[r["value"]]) if r in (a[4], a[5]) else r for r in clean]
    v = check_history(lost, {"sessions": {}, "dropped": 0})
    ff.check(not [x for x in v.anomalies if x.kind in ("counter_restart", "value_seen_twice")],
             f"self-test: a restart after session_gone flagged: {[x.detail for x in v.anomalies]}")
    print("  ok: a counter starting at 1 after a truthful session_gone passes")
    # The schedule: the same seed gives the same one; the constraints hold.
    ff.check(plan(42, 300) == plan(42, 300) and plan(42, 300) != plan(43, 300),
             "self-test: the schedule is not a function of the seed")
    ff.check(len(plan(42, 300, max_faults=5)) == 5, "self-test: NEMESIS_FAULTS not obeyed")
    p = {cls: Planned(0, 0, cls, "gw1", 0, 0) for cls in FAULTS}
    ff.check(not may_start(p["worker_kill"], [p["pause_long"]]), "self-test: two faults on one container")
    other = Planned(0, 0, "container_kill", "gw2", 0, 1)
    ff.check(not may_start(other, [p["pause_long"]]), "self-test: two containers down at once")
    ff.check(may_start(Planned(0, 0, "worker_kill", "gw2", 0, 0), [p["pause_long"]]),
             "self-test: a worker kill beside a pause refused")
    ff.check(not may_start(Planned(0, 0, "worker_kill", "gw3", 0, 0),
                           [p["worker_kill"], Planned(0, 0, "worker_kill", "gw2", 0, 0)]),
             "self-test: three faults at once")
    print("  ok: schedule: one seed one schedule; two on one container, two containers down, three "
          "at once refused")
    line = (f"2026-12-07T04:30:01.250000000Z 2026-12-07T04:30:01Z ERROR mcpgw::worker: {ff.FENCE_LINE}; "
            f"sessions dropped worker=gw2-9-abcdef dropped=1")
    wall0 = datetime.datetime(2026, 12, 7, 4, 30, 0, tzinfo=datetime.timezone.utc).timestamp()
    got = fence_times(line + "\nsomething else worker=gw2-1-x\n", wall0)
    ff.check(got == [{"type": "fence", "worker": "gw2-9-abcdef", "at": 1.25}],
             f"self-test: fence line read as {got}")
    print("  ok: fencing lines read with their time")
    print("nemesis self-test passed", flush=True)
    return 0


# --- Main ------------------------------------------------------------------------------


def settings() -> tuple[int, float, int | None]:
    seed_text = os.environ.get("NEMESIS_SEED", "")
    seed = int(seed_text) if seed_text else random.SystemRandom().randrange(2 ** 32)
    seconds = float(os.environ.get("NEMESIS_SECONDS", "300"))
    faults = os.environ.get("NEMESIS_FAULTS")
    return seed, seconds, int(faults) if faults else None


async def main() -> int:
    seed, seconds, max_faults = settings()
    planned = plan(seed, seconds, max_faults)
    if os.environ.get("NEMESIS_PLAN_PRINTED") != "1":  # scripts/nemesis.sh printed it first
        print_plan(seed, seconds, planned)
    ff.check(bool(ff.PROJECT), "MCPGW_COMPOSE_PROJECT is not set: run this through scripts/nemesis.sh")
    OUT.mkdir(parents=True, exist_ok=True)
    history_path, executed_path = OUT / f"history-{seed}.jsonl", OUT / f"executed-{seed}.json"
    history = History(history_path)
    wall0 = time.time() - ff.now()
    history.write({"type": "run", "seed": seed, "seconds": seconds, "lease_s": LEASE_S, "slots": SLOTS,
                   "wall0": wall0, "schedule": [asdict(p) for p in planned]})
    subnet_prefix = await ff.free_subnet_prefix()
    fleet = ff.Fleet(subnet_prefix, ff.free_port())
    ff.log(f"project {ff.PROJECT}: network {subnet_prefix}.0/24, load balancer {fleet.url}, "
           f"lease {LEASE_S:g} s, {SLOTS} client slots")
    await fleet.compose("up", "-d", "--no-build")
    await fleet.wait_healthy("lb")
    workers = ff.Workers(fleet)
    leases = await workers.refresh()
    ff.check(sorted(set(leases.values())) == list(GATEWAYS) and len(leases) == 2 * len(GATEWAYS),
             f"expected 2 workers on each of {GATEWAYS}, the directory has {leases}")
    ff.log("fleet up")
    clients = Clients(fleet, workers, history)
    refresher = asyncio.create_task(workers.keep_fresh())
    clients.start()
    load_started = ff.now()
    history.write({"type": "load", "at": round(load_started, 4)})
    settle_from = ff.now()
    try:
        await run_schedule(fleet, workers, planned, history, seconds, load_started)
        ff.log(f"faults done; settling {SETTLE_S:.0f} s")
        settle_from = ff.now() + SETTLE_S / 2
        await asyncio.sleep(SETTLE_S)
    finally:
        load_end = ff.now()
        await clients.stop()
        refresher.cancel()
    history.write({"type": "end", "load_end": round(load_end, 4), "settle_from": round(settle_from, 4)})
    executed = await read_executed(fleet)
    executed_path.write_text(json.dumps(executed))
    logs_dir = OUT / "logs"
    logs_dir.mkdir(exist_ok=True)
    for service in ("redis", "upstream", *GATEWAYS, "lb"):
        try:
            text = await fleet.logs(service)
        except ff.TestFailure:
            continue
        (logs_dir / f"{service}.log").write_text(text)
        if service in GATEWAYS:
            for fence in fence_times(text, wall0):
                history.write(fence)
    history.close()
    ff.log(f"history in {history_path.relative_to(ROOT)}, the upstream's record in "
           f"{executed_path.relative_to(ROOT)}, logs in {logs_dir.relative_to(ROOT)}/")
    records, executed = read_files(str(history_path), str(executed_path))
    errors = [r for r in records if r.get("type") == "fault" and r.get("error")]
    verdict = check_history(records, executed)
    print_verdict(verdict)
    for e in errors:
        ff.log(f"HARNESS ERROR in fault #{e['n']} {e['cls']} {e['target']}: {e['error']}")
    status = 1 if verdict.anomalies or errors else 0
    ff.log(f"nemesis seed {seed}: {'PASSED' if status == 0 else 'FAILED'} "
           f"({len(verdict.anomalies)} anomalies, {len(errors)} harness errors; "
           f"replay: NEMESIS_SEED={seed} NEMESIS_SECONDS={seconds:g} make nemesis)")
    return status


def check_main(history_path: str, executed_path: str) -> int:
    records, executed = read_files(history_path, executed_path)
    verdict = check_history(records, executed)
    print_verdict(verdict)
    return 1 if verdict.anomalies else 0


if __name__ == "__main__":
    args = sys.argv[1:]
    try:
        if args == ["--self-test"]:
            sys.exit(self_test())
        if len(args) == 3 and args[0] == "--check":
            sys.exit(check_main(args[1], args[2]))
        if args == ["--plan"]:
            seed, seconds, max_faults = settings()
            print_plan(seed, seconds, plan(seed, seconds, max_faults))
            sys.exit(0)
        if args:
            sys.exit("usage: nemesis.py [--self-test | --plan | --check HISTORY EXECUTED]")
        sys.exit(asyncio.run(main()))
    except ff.TestFailure as e:
        ff.log(f"FAILED: {e}")
        sys.exit(1)
