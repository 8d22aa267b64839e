"""The KV events of one `kvsparse serve` (tests/test_kv_events.sh): stored
blocks chained and equal to the prompt's full blocks, reused blocks not
announced again, removals under pressure, AllBlocksCleared on a reset, gapless
sequence numbers, the replay socket, and, after 64 concurrent requests with
aborts, the announced-minus-removed set the size of the cache's own.
Usage: check_events.py PORT PUB_ENDPOINT REPLAY_ENDPOINT API_KEY"""
import json
import os
import random
import socket
import sys
import threading
import time
import urllib.request

import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from subscriber import Subscriber  # noqa: E402

PORT, PUB, REPLAY, KEY = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
BS = 16
seed = int(os.environ.get("KVS_TEST_SEED", random.randrange(1 << 31)))
print(f"seed {seed} (set KVS_TEST_SEED={seed} to repeat)")
rng = random.Random(seed)


def post(path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def metric(name):
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in /metrics")


def complete(prompt, max_tokens=2):
    return post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def idle(sub):
    """Waits until no request runs or waits (the metrics are refreshed after
    a step's events are published), then takes every batch published."""
    deadline = time.monotonic() + 600
    while metric("kvsparse_num_requests_running") != 0 or metric("kvsparse_num_requests_waiting") != 0:
        assert time.monotonic() < deadline, "the server did not go idle in 600 s"
        sub.poll(50)
    sub.sync()


ctx = zmq.Context()
sub = Subscriber(ctx, PUB, b"kv", REPLAY)  # what the live socket misses (a slow joiner) comes from the replay socket

# ---- two requests that share a 1,000-token prefix -------------------------------
shared = [rng.randrange(10, 8000) for _ in range(1000)]
a = shared + [rng.randrange(10, 8000) for _ in range(100)]
b = shared + [rng.randrange(10, 8000) for _ in range(100)]
complete(a)
idle(sub)
a_blocks = len(a) // BS
assert sub.stored == a_blocks, f"{sub.stored} blocks stored, the prompt has {a_blocks} full blocks"
first = [h for h, (parent, _) in sub.blocks.items() if parent is None]
assert len(first) == 1, "one chain"
last = [h for h in sub.blocks if all(p != h for p, _ in sub.blocks.values())]
assert len(last) == 1, "one chain, no fork"
assert sub.chain_tokens(last[0]) == a[:a_blocks * BS], "the stored tokens are the prompt's full blocks"
a_hashes = set(sub.blocks)
n_events = len(sub.events)
r = complete(b)
assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == len(shared) // BS * BS, r["usage"]
idle(sub)
new = [e for e in sub.events[n_events:] if e[0] == "BlockStored"]
new_hashes = [h for e in new for h in e[1]]
assert not set(new_hashes) & a_hashes, "a cached block was announced again"
assert len(new_hashes) == len(b) // BS - len(shared) // BS, new_hashes
parent_of_first_new = new[0][2]
assert parent_of_first_new in a_hashes and sub.chain_tokens(parent_of_first_new) == shared[:len(shared) // BS * BS]
assert sub.chain_tokens(new_hashes[-1]) == b[:len(b) // BS * BS]
print(f"two requests sharing 1,000 tokens: {a_blocks} blocks stored, then {len(new_hashes)} more "
      f"(the 62 shared not announced again)")

# ---- pressure: blocks evicted are removed -----------------------------------------
for _ in range(3):
    complete([rng.randrange(10, 8000) for _ in range(1500)])
idle(sub)
assert sub.removed > 0, "no BlockRemoved under pressure"
assert sub.stored - sub.removed == len(sub.blocks) == metric("kvsparse_prefix_cache_reusable_blocks")
print(f"under pressure: {sub.removed} blocks removed, {len(sub.blocks)} reusable (the cache says the same)")

# ---- a subscriber that joins late gets what it missed from the replay socket --------
# (a reset until it has one batch live: when its subscription reaches the server is ZeroMQ's business)
late = Subscriber(ctx, PUB, b"kv", REPLAY)

# ---- a reset --------------------------------------------------------------------------
deadline = time.monotonic() + 120
while late.joined_at is None:
    assert time.monotonic() < deadline, "the late subscriber got nothing live in 120 s"
    assert post("/reset_prefix_cache", {}) == {"status": "ok"}
    late.poll(1000)
idle(sub)
late.sync()
assert min(late.batches) == 0 and late.blocks == sub.blocks and late.cleared == sub.cleared >= 1, \
    "the late subscriber's view differs"
assert late.joined_at > 0
print(f"a subscriber that joined at seq {late.joined_at} replayed the {late.joined_at} batches it missed "
      f"and holds the same view")
assert sub.events[-1] == ["AllBlocksCleared"] and not sub.blocks
assert metric("kvsparse_prefix_cache_reusable_blocks") == 0
r = complete(a)
assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "the reset cache still gave a hit"
idle(sub)

# ---- 64 concurrent requests, a third aborted mid-stream -----------------------------
docs = [[rng.randrange(10, 8000) for _ in range(rng.randrange(200, 700))] for _ in range(4)]
jobs = []
for i in range(64):
    d = docs[rng.randrange(len(docs))]
    jobs.append((d[:rng.randrange(len(d) // 2, len(d) + 1)] + [rng.randrange(10, 8000) for _ in range(rng.randrange(1, 80))],
                 rng.randrange(3) == 0, rng.randrange(1, 24)))
errors = []


def one(prompt, abort, max_tokens):
    try:
        if not abort:
            complete(prompt, max_tokens)
            return
        body = json.dumps({"prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True}).encode()
        s = socket.create_connection(("127.0.0.1", PORT), timeout=300)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() +
                  b"\r\n\r\n" + body)
        got = b""
        while b"data:" not in got:  # the first token, then the client leaves
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
        s.close()
    except Exception as e:  # noqa: BLE001
        errors.append(repr(e))


threads = [threading.Thread(target=one, args=j) for j in jobs]
for t in threads:
    t.start()
while any(t.is_alive() for t in threads):
    sub.poll(50)
for t in threads:
    t.join()
assert not errors, errors
idle(sub)
reusable = metric("kvsparse_prefix_cache_reusable_blocks")
assert len(sub.blocks) == reusable, f"announced minus removed: {len(sub.blocks)}; the cache's own: {reusable}"
# and each announced chain is in the cache: a prompt of its tokens (and one more) is a hit for all of them
# (a check's own block may evict another chain's: the events say so before the next check)
checked = 0
leaves = [h for h in sub.blocks if all(p != h for p, _ in sub.blocks.values())]
for h in leaves[:24]:
    sub.sync()  # what the last check's own blocks evicted
    if h not in sub.blocks:
        continue
    try:
        chain = sub.chain_tokens(h)
    except KeyError:  # a parent left: no prompt reaches this block any more
        continue
    r = complete(chain + [11], 1)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == len(chain), (len(chain), r["usage"])
    checked += 1
assert checked > 0
idle(sub)
print(f"64 concurrent requests ({sum(j[1] for j in jobs)} aborted): {sub.stored} stored, {sub.removed} removed, "
      f"{sub.cleared} cleared; {int(reusable)} reusable = the cache's {int(reusable)}; {checked} announced chains "
      f"hit in full")

# ---- sequence numbers and the replay socket ---------------------------------------------
seqs = sorted(sub.batches)
assert seqs == list(range(len(seqs))), "the sequence numbers have a gap"
replayed = sub.replay(0)
assert [s for s, _ in replayed] == seqs, "the replay does not return every batch"
assert all(sub.batches[s] == p for s, p in replayed), "a replayed batch differs from the published one"
tail = sub.replay(len(seqs) - 3)
assert [s for s, _ in tail] == seqs[-3:]
print(f"{len(seqs)} batches, seq 0..{seqs[-1]} without a gap; the replay socket returned them all, byte for byte")
print("1 passed, 0 failed")
