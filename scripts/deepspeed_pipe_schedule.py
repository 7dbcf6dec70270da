"""Does the shape of DeepSpeed's pipeline schedule cost time? (docs/planner.md, held-out runs, "Scale and size")

DeepSpeed's `TrainSchedule` (deepspeed/runtime/pipe/schedule.py) runs 2(m + p - 1) steps per stage; on even steps
even stages run a forward and odd stages a backward (and the reverse on odd steps), and every send is blocking and
paired with the neighbour's receive. This replays that order with rendezvous transfers of a given duration and
prints the makespan against Megatron's 1F1B time (m + p - 1)(F + B).
"""

from __future__ import annotations

import json


def _micro_batch(step: int, stage: int, stages: int) -> tuple[int, bool]:
    """(micro-batch, is_forward) of `stage` at `step`, DeepSpeed's mapping."""
    if step % 2 == stage % 2:
        return (step - stage % 2) // 2 - stage // 2, True
    if step % 2 == 0:
        return step // 2 - stages + (stage + 1) // 2, False
    return (step - 1) // 2 - stages + 1 + stage // 2, False


def stage_program(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    ops, prev = [], -1
    valid = range(micro_batches).__contains__
    for step in range(2 * (micro_batches + stages - 1)):
        mb, forward = _micro_batch(step, stage, stages)
        if forward and stage > 0:
            ops += [("recv_act", mb)] * valid(mb) + [("send_grad", prev)] * valid(prev)
        if not forward and stage < stages - 1:
            ops += [("send_act", prev)] * valid(prev) + [("recv_grad", mb)] * valid(mb)
        if valid(mb):
            ops.append(("F" if forward else "B", mb))
        prev = mb
    return ops


def makespan(stages: int, micro_batches: int, fwd: float, bwd: float, transfer: float = 0.0) -> float:
    progs = [stage_program(s, stages, micro_batches) for s in range(stages)]
    pc, clock, waiting = [0] * stages, [0.0] * stages, {}
    while any(pc[s] < len(progs[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            while pc[s] < len(progs[s]):
                op, mb = progs[s][pc[s]]
                if op in ("F", "B"):
                    clock[s] += fwd if op == "F" else bwd
                    pc[s] += 1
                    moved = True
                    continue
                peer = s + 1 if op in ("send_act", "recv_grad") else s - 1
                key = (min(s, peer), op.endswith("act"), mb)
                if key in waiting and waiting[key] == peer:
                    del waiting[key]
                    clock[s] = clock[peer] = max(clock[s], clock[peer]) + transfer
                    pc[s], pc[peer] = pc[s] + 1, pc[peer] + 1
                    moved = True
                elif key not in waiting:
                    waiting[key] = s  # arrived first: wait for the peer
                    moved = True
                break
        if not moved:
            raise RuntimeError("schedule deadlocked")
    return max(clock)


def main() -> None:
    for stages, micro_batches in ((4, 32), (12, 128), (35, 160), (35, 240)):
        fwd, bwd = 1.0, 3.0  # full recompute: backward = recomputed forward + twice the forward
        ds = makespan(stages, micro_batches, fwd, bwd)
        one_f_one_b = (micro_batches + stages - 1) * (fwd + bwd)
        print(json.dumps({"stages": stages, "micro_batches": micro_batches, "deepspeed": ds,
                          "one_f_one_b": one_f_one_b, "ratio": ds / one_f_one_b}))


if __name__ == "__main__":
    main()
