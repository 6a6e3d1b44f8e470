"""One table of the load results ci/gpu_serving.sh left in a folder (load-ENGINE-CLIENTS.TAG.json,
as serve_round in ci/gpu_lib.sh names them): run tag, engine, clients, tok/s, TTFT p50/p99,
done/failed, tokens generated (a server that stops early serves fewer).  Usage: python3 ci/load_table.py FOLDER"""
import json, sys
from pathlib import Path
from tabulate import tabulate
rows = []
for f in sorted(Path(sys.argv[1]).glob("load-*.json")):
    d = json.loads(f.read_text())
    engine, rest = f.stem.split("-", 1)[1].rsplit("-", 1)[0], f.stem.rsplit("-", 1)[1]
    n, tag = rest.split(".", 1)
    rows.append([tag, engine, int(n), d["tokens_per_s"], round(d["ttft_p50_s"] * 1e3, 1),
                 round(d["ttft_p99_s"] * 1e3, 1), f"{d['completed']}/{d['failed']}", d.get("generated_tokens")])
rows.sort(key=lambda r: (r[2], r[0], r[1]))
print(tabulate(rows, headers=["run", "engine", "clients", "tok/s", "TTFT p50 ms", "TTFT p99 ms",
                              "done/failed", "tokens"], tablefmt="github"))
