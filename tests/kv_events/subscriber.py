"""A KV events subscriber as a router keeps one (llm-d's precise prefix-cache
scorer, Dynamo's KV router): decodes vLLM's KVEventBatch layout, checks that
each event makes sense given the ones before, and keeps the set of blocks the
replica can reuse, with each block's tokens chained from its parent.
Debian's python3-zmq and python3-msgpack (/usr/bin/python3)."""
import msgpack
import zmq


class Subscriber:
    def __init__(self, ctx, endpoint, topic=b"kv", replay=None):
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.ctx, self.replay_endpoint, self.topic = ctx, replay, topic
        self.batches = {}       # seq -> payload as received
        self.blocks = {}        # hash -> (parent hash, tokens of this block)
        self.stored = self.removed = self.cleared = 0
        self.events = []        # every decoded event, in order
        self.next_seq = None    # the seq the next message must carry
        self.joined_at = None   # the first seq received live

    def poll(self, timeout_ms=300):
        """Applies the messages that come within timeout_ms of each other; the number applied."""
        n = 0
        while self.sock.poll(timeout_ms):
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == self.topic, topic
            assert len(seq) == 8
            self.take(int.from_bytes(seq, "big", signed=True), payload)
            n += 1
        return n

    def take(self, seq, payload, live=True):
        if live and self.joined_at is None:
            self.joined_at = seq  # the first batch received live
        if self.next_seq is not None and seq < self.next_seq:  # had from the replay socket already
            assert self.batches[seq] == payload, f"batch {seq} differs live and replayed"
            return
        if self.next_seq is None and seq > 0:   # joined late: what came before, from the replay socket
            for s, p in self.replay(0):
                if s < seq:
                    self.take(s, p, live=False)
        assert self.next_seq in (None, seq), f"seq {seq} after {self.next_seq - 1}: a gap"
        self.next_seq = seq + 1
        self.batches[seq] = payload
        self.apply(payload)

    def apply(self, payload):
        batch = msgpack.unpackb(payload, raw=False)
        assert isinstance(batch, list) and len(batch) == 3, batch
        ts, events, dp_rank = batch
        assert isinstance(ts, float) and ts > 1.6e9 and dp_rank == 0, batch
        for e in events:
            self.events.append(e)
            tag = e[0]
            if tag == "BlockStored":
                assert len(e) == 7, e
                _, hashes, parent, tokens, block_size, lora_id, medium = e
                assert lora_id is None and medium in ("CPU", "GPU"), e
                assert len(tokens) == len(hashes) * block_size, e
                assert parent is None or isinstance(parent, int), e
                for i, h in enumerate(hashes):
                    assert isinstance(h, int) and 0 <= h < 2**64, e
                    assert h not in self.blocks, f"block {h:x} stored twice"
                    self.blocks[h] = (parent, tokens[i * block_size:(i + 1) * block_size])
                    parent = h
                    self.stored += 1
            elif tag == "BlockRemoved":
                assert len(e) == 3 and e[2] in ("CPU", "GPU"), e
                for h in e[1]:
                    assert h in self.blocks, f"block {h:x} removed, never stored"
                    del self.blocks[h]
                    self.removed += 1
            else:
                assert e == ["AllBlocksCleared"], e
                self.blocks.clear()
                self.cleared += 1

    def sync(self):
        """Takes every batch published so far from the replay socket (the live
        ones still on their way are then skipped): a replica publishes a step's
        batch before that step's outputs, so after a response this view holds
        every event up to it, however late the live socket is."""
        self.poll(0)  # what came live first, in order
        for s, p in self.replay(self.next_seq or 0):
            if self.next_seq is None or s >= self.next_seq:
                self.take(s, p, live=False)

    def replay(self, first):
        """The kept batches from seq first, through the replay socket: [(seq, payload)]."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.connect(self.replay_endpoint)
        sock.send_multipart([b"", first.to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(10000), "the replay socket did not answer"
            empty, seq, payload = sock.recv_multipart()
            assert empty == b""
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                assert payload == b""
                break
            out.append((seq, payload))
        sock.close(0)
        return out

    def chain_tokens(self, h):
        """The tokens from the prompt's start to the end of block h (its parents' first)."""
        parts = []
        while h is not None:
            parent, tokens = self.blocks[h]
            parts.append(tokens)
            h = parent
        return [t for p in reversed(parts) for t in p]
