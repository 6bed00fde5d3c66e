"""v0 (shipped) vs v1 (whole documents) on the 55 SmolLM2 dev prompts: macro score and pooled Full-call rate per
threshold, and per task at each v1 threshold."""
import collections, json, sys
V0 = "benchmarks/results/smollm2/calibrate-dev/calibration_records.jsonl"
V1 = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/smollm2/head-v1-whole-docs/dev-eval/results.jsonl"

def load(path):
    out = collections.defaultdict(dict)
    for line in open(path):
        r = json.loads(line)
        if r.get("kind") not in ("oda", "full") and not str(r.get("policy", "")).startswith(("oda", "full")):
            continue
        out[(r["kind"], r["threshold"])][r["id"]] = r
    return out

def summary(recs):
    tasks = collections.defaultdict(list)
    for r in recs.values():
        tasks[r["task"]].append(r["score"])
    macro = sum(sum(v) / len(v) for v in tasks.values()) / len(tasks) * (100 if max(max(v) for v in tasks.values()) <= 1 else 1)
    full = sum(r["full_calls"] for r in recs.values()); decided = sum(r["routed_steps"] - r.get("window_steps", 0) for r in recs.values())
    routed = sum(r["routed_steps"] for r in recs.values())
    return macro, full / routed, len(recs), {t: sum(v) / len(v) for t, v in tasks.items()}

v0, v1 = load(V0), load(V1)
print("head | theta | n | macro | Full calls / routed steps")
for name, runs in (("v0", v0), ("v1", v1)):
    for key in sorted(runs, key=lambda k: (k[0], k[1] if k[1] is not None else -9)):
        m, rate, n, _ = summary(runs[key])
        print(f"{name} | {key[0]}@{key[1]} | {n} | {m:.1f} | {rate:.1%}")
print()
tasks = sorted(summary(next(iter(v1.values())))[3])
for key in sorted(k for k in v1 if k[0] == "oda"):
    print(f"per task v1 oda@{key[1]}:", {t: round(summary(v1[key])[3][t], 2) for t in tasks})

print()
ids = set.intersection(*(set(r) for r in v1.values()))
print(f"on the {len(ids)} prompts every v1 arm has:")
for name, runs in (("v0", v0), ("v1", v1)):
    for key in sorted(runs, key=lambda k: (k[0], k[1] if k[1] is not None else -9)):
        sub = {i: r for i, r in runs[key].items() if i in ids}
        m, rate, n, _ = summary(sub)
        print(f"  {name} | {key[0]}@{key[1]} | {n} | {m:.1f} | {rate:.1%}")

pairs = [(("full", None), None)] + [(("oda", a), ("oda", b)) for a, b in
                                     ((0.1, 0.0), (0.2, 0.05), (0.35, 0.1), (0.5, 0.2))]
extra = sys.argv[2] if len(sys.argv) > 2 else None
if extra:
    for k, v in load(extra).items():
        v1[k] = v
print()
header = ["task"] + [f"v0 {a[1]}" + (f" / v1 {b[1]}" if b else "") for a, b in pairs]
print("| " + " | ".join(header) + " |")
for t in tasks + ["macro", "pooled"]:
    cells = []
    for a, b in pairs:
        sa = summary(v0[a]) if a in v0 else None
        sb = summary(v1[b]) if b and b in v1 else None
        def fmt(s):
            if s is None: return "-"
            if t == "macro": return f"{s[0]:.1f}"
            if t == "pooled": return f"{s[1]:.1%}"
            return f"{100 * s[3][t]:.0f}"
        cells.append(fmt(sa) + (f" / {fmt(sb)}" if b else ""))
    print(f"| {t} | " + " | ".join(cells) + " |")
