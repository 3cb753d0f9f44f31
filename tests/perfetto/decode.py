#!/usr/bin/env python3
"""Decodes a gpu-observer --perfetto trace with Perfetto's own protos (PyPI `perfetto`, pinned
in xtask) and prints a JSON summary for the tests (tests/tests/perfetto.rs): tracks, slices and
their nesting per track, instants, flows, counters, and every violation of the sequence and
interning rules found.

Independent of the writer: nothing here is shared with the Rust code. Packets are read one by
one, as trace_processor's tokenizer reads them, so a file cut short decodes up to its last whole
packet (the torn tail is reported, not an error). Events are then sorted by timestamp (stable, as
trace_processor sorts them) and replayed per track: SLICE_END closes the latest open slice.

usage: decode.py TRACE
"""

import collections
import json
import sys

from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

CLEARED = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
NEEDS = pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE


def frames(data):
    """(packet bytes or None for a torn tail, offset)."""
    i = 0
    while i < len(data):
        if data[i] != 0x0A:
            raise ValueError(f"byte {i}: not a Trace.packet field")
        j, n, shift = i + 1, 0, 0
        while True:
            if j >= len(data):
                yield None, i
                return
            b = data[j]
            j += 1
            n |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                break
        if j + n > len(data):
            yield None, i
            return
        yield data[j:j + n], i
        i = j + n


def main(path):
    data = open(path, "rb").read()
    errors = []
    packets = 0
    torn = 0
    tracks = {}
    events = []  # (ts, order, track, type, name, flow_ids, terminating, annotations, counter)
    names, ann_names, strings = {}, {}, {}
    cleared = False
    clock = None
    for body, off in frames(data):
        if body is None:
            torn = len(data) - off
            break
        p = pb.TracePacket()
        p.ParseFromString(body)
        packets += 1
        flags = p.sequence_flags
        if p.trusted_packet_sequence_id != 1:
            errors.append(f"packet {packets}: sequence {p.trusted_packet_sequence_id}")
        if flags & CLEARED:
            cleared = True
            names, ann_names, strings = {}, {}, {}
        elif packets == 1:
            errors.append("first packet does not clear the incremental state")
        if p.HasField("clock_snapshot"):
            clock = {
                "primary": p.clock_snapshot.primary_trace_clock,
                "clocks": [c.clock_id for c in p.clock_snapshot.clocks],
            }
        if p.HasField("trace_packet_defaults") and p.trace_packet_defaults.timestamp_clock_id != 3:
            errors.append(f"packet {packets}: default clock {p.trace_packet_defaults.timestamp_clock_id}")
        uses = p.HasField("interned_data") or p.HasField("track_event")
        if uses and not (flags & NEEDS):
            errors.append(f"packet {packets}: uses incremental state without SEQ_NEEDS_INCREMENTAL_STATE")
        if uses and not cleared:
            errors.append(f"packet {packets}: before the state was cleared")
        if p.HasField("interned_data"):
            d = p.interned_data
            for e in d.event_names:
                names[e.iid] = e.name
            for e in d.debug_annotation_names:
                ann_names[e.iid] = e.name
            for e in d.debug_annotation_string_values:
                strings[e.iid] = e.str.decode("utf-8", "replace")
        if p.HasField("track_descriptor"):
            t = p.track_descriptor
            if t.uuid == 0:
                errors.append("a track with uuid 0")
            info = {"uuid": str(t.uuid), "parent": str(t.parent_uuid) if t.HasField("parent_uuid") else None,
                    "name": t.name if t.HasField("name") else None}
            if t.HasField("process"):
                info.update(kind="process", pid=t.process.pid, name=t.process.process_name)
            elif t.HasField("thread"):
                info.update(kind="thread", pid=t.thread.pid, tid=t.thread.tid, name=t.thread.thread_name)
            elif t.HasField("counter"):
                info.update(kind="counter", unit=t.counter.unit, unit_name=t.counter.unit_name)
            else:
                info.update(kind="track")
            old = tracks.get(str(t.uuid))
            if old is not None and old != info:
                errors.append(f"track {t.uuid} described twice differently")
            tracks[str(t.uuid)] = info
        if p.HasField("track_event"):
            e = p.track_event
            name = None
            if e.HasField("name_iid"):
                name = names.get(e.name_iid)
                if name is None:
                    errors.append(f"packet {packets}: name_iid {e.name_iid} used before it was defined")
            elif e.HasField("name"):
                name = e.name
            if str(e.track_uuid) not in tracks:
                errors.append(f"packet {packets}: event on undescribed track {e.track_uuid}")
            anns = {}
            for a in e.debug_annotations:
                key = ann_names.get(a.name_iid) if a.HasField("name_iid") else a.name
                if key is None:
                    errors.append(f"packet {packets}: annotation name_iid {a.name_iid} undefined")
                    continue
                which = a.WhichOneof("value")
                if which == "string_value_iid":
                    v = strings.get(a.string_value_iid)
                    if v is None:
                        errors.append(f"packet {packets}: string_value_iid {a.string_value_iid} undefined")
                else:
                    v = getattr(a, which) if which else None
                anns[key] = v
            counter = e.double_counter_value if e.HasField("double_counter_value") else None
            events.append((p.timestamp, len(events), str(e.track_uuid), e.type, name,
                           list(e.flow_ids), list(e.terminating_flow_ids), anns, counter))

    events.sort(key=lambda x: (x[0], x[1]))
    per = collections.defaultdict(lambda: {
        "slices": 0, "names": collections.Counter(), "instants": collections.Counter(),
        "unmatched_ends": 0, "max_depth": 0, "nested": collections.Counter(), "counters": []})
    stacks = collections.defaultdict(list)
    active = {}
    flows = {"started": 0, "steps": 0, "terminated": 0, "unmatched_terminations": 0}
    instants = []
    for ts, _, track, ty, name, fids, tids, anns, counter in events:
        t = per[track]
        st = stacks[track]
        if ty == pb.TrackEvent.TYPE_SLICE_BEGIN:
            t["slices"] += 1
            t["names"][name] += 1
            if st:
                t["nested"][f"{st[-1]} > {name}"] += 1
            st.append(name)
            t["max_depth"] = max(t["max_depth"], len(st))
        elif ty == pb.TrackEvent.TYPE_SLICE_END:
            if st:
                st.pop()
            else:
                t["unmatched_ends"] += 1
        elif ty == pb.TrackEvent.TYPE_INSTANT:
            t["instants"][name] += 1
            if st:
                t["nested"][f"{st[-1]} > {name}"] += 1
            instants.append({"ts": ts, "track": track, "name": name, "args": anns})
        elif ty == pb.TrackEvent.TYPE_COUNTER:
            t["counters"].append(counter)
        for f in fids:
            if f in active:
                flows["steps"] += 1
            else:
                flows["started"] += 1
            active[f] = True
        for f in tids:
            if active.pop(f, None):
                flows["terminated"] += 1
            else:
                flows["unmatched_terminations"] += 1
    flows["open"] = len(active)
    out_tracks = {}
    for uuid, info in tracks.items():
        t = per.get(uuid)
        entry = dict(info)
        if t is not None:
            entry.update(slices=t["slices"], names=dict(t["names"]), instants=dict(t["instants"]),
                         unclosed=len(stacks[uuid]), unmatched_ends=t["unmatched_ends"],
                         max_depth=t["max_depth"], nested=dict(t["nested"]), counters=t["counters"])
        out_tracks[uuid] = entry
    json.dump({"packets": packets, "torn_tail_bytes": torn, "clock": clock, "errors": errors,
               "tracks": out_tracks, "flows": flows, "instants": instants}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main(sys.argv[1])
