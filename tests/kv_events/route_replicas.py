"""An event-driven router over three `kvsparse serve` replicas
(tests/test_kv_router.sh), the way llm-d's precise prefix-cache scorer routes:
a prefix index per replica kept from its KV events (keyed by the tokens, not by
the replica's hashes), each request's prompt ids from the replica's
/v1/chat/completions/render, and the request sent to the replica holding the
longest cached prefix (the least used one on a tie). 40 two-turn conversations
go through it, then (caches reset) through round robin; the prefix-cache hit
rate of the second turns, from /metrics, for both.
Usage: route_replicas.py API_KEY PORT:PUB PORT:PUB PORT:PUB"""
import json
import os
import random
import sys
import urllib.request

import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from subscriber import Subscriber  # noqa: E402

KEY = sys.argv[1]
REPLICAS = [(int(a.split(":", 1)[0]), a.split(":", 1)[1]) for a in sys.argv[2:]]
BS = 16
seed = int(os.environ.get("KVS_TEST_SEED", random.randrange(1 << 31)))
print(f"seed {seed} (set KVS_TEST_SEED={seed} to repeat)")
rng = random.Random(seed)
WORDS = ("harbour grey marigold access code river stone lantern copper orchard violet signal winter "
         "meadow falcon amber quiet engine garden silver letter window bridge canyon ember harvest").split()


def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def metric(port, name):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} on port {port}")


class PrefixIndex:
    """One replica's reusable blocks keyed by the tokens from the prompt's start."""

    def __init__(self, sub):
        self.sub, self.seen, self.key_of, self.keys = sub, 0, {}, set()

    def update(self):
        while self.sub.poll(20):
            pass
        for e in self.sub.events[self.seen:]:
            if e[0] == "BlockStored":
                _, hashes, parent, tokens = e[:4]
                for i, h in enumerate(hashes):
                    pk = None if parent is None else self.key_of.get(parent)
                    if parent is not None and pk is None:
                        parent = h  # its parent left the index: not reachable from a prompt's start
                        continue
                    k = hash((pk, tuple(tokens[i * BS:(i + 1) * BS])))
                    self.key_of[h] = k
                    self.keys.add(k)
                    parent = h
            elif e[0] == "BlockRemoved":
                for h in e[1]:
                    self.keys.discard(self.key_of.pop(h, None))
            else:
                self.key_of.clear()
                self.keys.clear()
        self.seen = len(self.sub.events)

    def cached_blocks(self, ids):
        k, n = None, 0
        for i in range(len(ids) // BS):
            k = hash((k, tuple(ids[i * BS:(i + 1) * BS])))
            if k not in self.keys:
                break
            n += 1
        return n


ctx = zmq.Context()
indexes = [PrefixIndex(Subscriber(ctx, pub)) for _, pub in REPLICAS]
sent = [0] * len(REPLICAS)


def route_by_index(body):
    ids = post(REPLICAS[0][0], "/v1/chat/completions/render", body)["token_ids"]
    for ix in indexes:
        ix.update()
    scores = [ix.cached_blocks(ids) for ix in indexes]
    best = max(scores)
    return min((r for r in range(len(REPLICAS)) if scores[r] == best), key=lambda r: sent[r])


rr = {"next": 0}


def route_round_robin(body):
    r = rr["next"] % len(REPLICAS)
    rr["next"] += 1
    return r


def document(i):
    names = [f"{rng.choice(WORDS).title()}{i}x{k}" for k in range(40)]
    facts = [f"The access code for {n} is {rng.randrange(10000, 99999)}." for n in names]
    filler = [" ".join(rng.choice(WORDS) for _ in range(12)) + "." for _ in range(30)]
    text = " ".join(rng.sample(facts + filler, len(facts) + len(filler)))
    return text, names


conversations = [document(i) for i in range(40)]


def run(route):
    for ix in indexes:
        ix.update()
    turns = []
    for text, names in conversations:
        turns.append({"messages": [{"role": "user", "content": f"{text} What is the access code for {names[3]}?"}],
                      "max_tokens": 8, "temperature": 0})
    answers = []
    for body in turns:
        r = route(body)
        sent[r] += 1
        out = post(REPLICAS[r][0], "/v1/chat/completions", body)
        answers.append(out["choices"][0]["message"]["content"])
    before = [(metric(p, "kvsparse_prefix_cache_hits_total"), metric(p, "kvsparse_prefix_cache_queries_total"))
              for p, _ in REPLICAS]
    cached = prompt = 0
    for body, (text, names), answer in zip(turns, conversations, answers):
        body2 = {"messages": body["messages"] + [{"role": "assistant", "content": answer},
                                                  {"role": "user", "content": f"And the access code for {names[7]}?"}],
                 "max_tokens": 8, "temperature": 0}
        r = route(body2)
        sent[r] += 1
        u = post(REPLICAS[r][0], "/v1/chat/completions", body2)["usage"]
        cached += u["prompt_tokens_details"]["cached_tokens"]
        prompt += u["prompt_tokens"]
    after = [(metric(p, "kvsparse_prefix_cache_hits_total"), metric(p, "kvsparse_prefix_cache_queries_total"))
             for p, _ in REPLICAS]
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    assert hits == cached, f"/metrics counted {hits} hit tokens, the responses {cached}"
    return hits / queries, prompt / len(turns)


index_rate, mean_prompt = run(route_by_index)
spread = list(sent)
for port, _ in REPLICAS:
    assert post(port, "/reset_prefix_cache", {}) == {"status": "ok"}
rr_rate, _ = run(route_round_robin)
print(f"turn 2 prefix-cache hit rate over 40 conversations (second prompts of {mean_prompt:.0f} tokens): "
      f"routed by the KV events {100 * index_rate:.1f}% (requests per replica {spread}), round robin {100 * rr_rate:.1f}%")
assert index_rate >= 0.90, f"the event-driven router got {100 * index_rate:.1f}% on turn 2"
assert index_rate > rr_rate
print("1 passed, 0 failed")
