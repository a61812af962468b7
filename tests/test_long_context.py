"""Long contexts: tau by the prompt's length (`metrics.context_figures`, the ``by_context`` of eval and
eval-sets), a user's long prompt through eval-sets and one past the target's positions refused, the
long-code set's lengths counted with the target's tokenizer (up to 30K tokens where the target has
the positions), the module split that keeps its modules out of every training row (the code
prompts, the recipe's long rows), and the long code target (``make_code_target.py --size long``)
that holds them out too."""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from helpers import ROOT, TINY_TARGET, RecordingSink
from test_evaluate import export_random_drafter
from transformers import AutoTokenizer

from dflash_cache.eval import benchsets, code_prompts, long_code
from dflash_cache.eval.metrics import context_figures, kept_figures, timed
from dflash_cache.rows.chat import DataError

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def wide_target(tmp_path: Path, positions: int = 8192) -> Path:
    """The tiny target with more positions in its config (RoPE has no table to outgrow): long
    prompts fit it where the bundled one's 4,096 do not."""
    out = tmp_path / "wide-target"
    shutil.copytree(TINY_TARGET, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}))
    return out


def prompt_tokens(tokenizer, message: str) -> int:
    """A user message's tokens as the target is asked it: its chat template with the generation prompt."""
    return len(tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=True,
                                             add_generation_prompt=True, return_dict=True)["input_ids"])  # fmt: skip


def module_of(source: str) -> str:
    """``stdlib/xml/dom/minidom.py:Node.fn`` -> ``xml.dom.minidom``; a package's ``__init__`` is the package."""
    path = source.split(":")[0].split("/", 1)[1].removesuffix(".py").removesuffix("/__init__")
    return path.replace("/", ".")


def held_out(module: str) -> bool:
    return int(hashlib.sha256(f"python-module:{module}".encode()).hexdigest()[:8], 16) % 100 < 15


def test_by_context_groups_the_prompts_by_their_tokens():
    """Each bucket's figures are those of its prompts alone, the buckets doubling from 1,024 tokens."""
    rng = random.Random(0)
    tokens = [1, 1023, 1024, 1025, 2048, 2049, 4096, 4097, 7000, 8192, 8193, 70000, 131072, 131073]
    samples = [{"prompt_tokens": n, "new_tokens": rng.randint(0, 50),
                "acceptance_lengths": [rng.randint(1, 8) for _ in range(rng.randint(0, 6))]}
               for n in tokens * 3]  # fmt: skip
    got = context_figures(samples)

    def edge(n: int) -> int:
        return 1024 * 2 ** max(0, math.ceil(math.log2(n / 1024)))

    edges = sorted({edge(n) for n in tokens})
    assert list(got) == ["0-1K", "1K-2K", "2K-4K", "4K-8K", "8K-16K", "64K-128K", "128K-256K"]
    for name, e in zip(got, edges, strict=True):
        mine = [s for s in samples if edge(s["prompt_tokens"]) == e]
        steps = [n for s in mine for n in s["acceptance_lengths"]]
        taus = [sum(s["acceptance_lengths"]) / len(s["acceptance_lengths"]) for s in mine if s["acceptance_lengths"]]
        b = got[name]
        assert b["tokens"] == [1 if e == 1024 else e // 2 + 1, e] and b["prompts"] == len(mine)
        assert b["steps"] == len(steps) and b["new_tokens"] == sum(s["new_tokens"] for s in mine)
        assert b["tau"] == pytest.approx(sum(steps) / len(steps))
        assert b["tau_per_prompt"] == pytest.approx(sum(taus) / len(taus))
        assert "tok_s" not in b  # untimed samples (a batched decode) give no speed


def test_by_context_speed_is_the_timed_prompts_tokens_over_their_seconds():
    """A decode at batch 1 times each prompt: a bucket's tokens/s is its tokens over its seconds, its
    ms a step leaves the prefills out, and its speedup sets it against the target alone's tokens/s
    on the same prompts; a bucket with an untimed prompt reports no speed."""
    samples = [{"prompt_tokens": n, "new_tokens": new, "acceptance_lengths": [2] * steps, "steps": steps,
                **timed((seconds, prefill), (target_seconds, 0.01), new)}
               for n, new, steps, seconds, prefill, target_seconds in ((100, 40, 20, 0.5, 0.1, 1.0),
                                                                       (900, 60, 30, 1.5, 0.3, 2.0),
                                                                       (3000, 10, 5, 0.4, 0.2, 0.5))]  # fmt: skip
    got = context_figures(samples)
    short = got["0-1K"]
    assert short["tok_s"] == pytest.approx(100 / 2.0) and short["ms_per_step"] == pytest.approx(1000 * 1.6 / 50)
    assert short["target_tok_s"] == pytest.approx(100 / 3.0) and short["speedup"] == pytest.approx(1.5)
    assert got["2K-4K"]["speedup"] == pytest.approx((10 / 0.4) / (10 / 0.5))
    no_target = [s | {"target_seconds": None} for s in samples]
    assert "speedup" not in context_figures(no_target)["0-1K"] and "tok_s" in context_figures(no_target)["0-1K"]
    assert "tok_s" not in context_figures([samples[0], samples[1] | timed(None, None, None)])["0-1K"]


def test_kept_sets_each_file_against_its_own_shortest_prompts(tmp_path, capsys):
    """``kept``: a bucket's tau per prompt, on the prompts whose file is asked at a shorter length too,
    over those files' tau per prompt at the shortest length each is asked at, against a count by
    hand; a file's shortest prompt, or a prompt that names no file, is left out of it. Through a real
    decode the rows' ``source`` reaches the samples and the figure."""

    def sample(tokens: int, source: str | None, lengths: list[int]) -> dict:
        return {"prompt_tokens": tokens, "new_tokens": sum(lengths), "acceptance_lengths": lengths, "source": source}

    samples = [sample(900, "a.py", [2, 2]), sample(800, "b.py", [4]), sample(700, None, [8]),
               sample(3000, "a.py", [1, 2]), sample(3500, "b.py", [3, 3, 3]), sample(3900, "c.py", [8]),
               sample(3100, None, [8]), sample(6000, "c.py", [5]), sample(7000, None, [5])]  # fmt: skip
    got = context_figures(samples)
    assert "kept" not in got["0-1K"]  # every file's shortest
    assert got["2K-4K"]["kept"] == pytest.approx(((1.5 + 3) / 2) / ((2 + 4) / 2)) and got["2K-4K"]["kept_prompts"] == 2
    assert got["4K-8K"]["kept"] == pytest.approx(5 / 8) and got["4K-8K"]["kept_prompts"] == 1  # c.py from 2K-4K
    assert kept_figures(samples[3:4], [sample(100, "a.py", []), *samples[3:5]]) == {}  # the shorter made no step
    assert all("kept" not in b for b in context_figures([s | {"source": None} for s in samples]).values())

    from dflash_cache.eval.config import EvalConfig
    from dflash_cache.eval.decode import evaluate

    code = (ROOT / "dflash_cache" / "generate" / "decoder.py").read_text()
    other = (ROOT / "dflash_cache" / "eval" / "decode.py").read_text()
    rows = [{"prompt": long_code.continue_user(code[:2000]), "source": "decoder.py"},
            {"prompt": long_code.continue_user(code[:5000]), "source": "decoder.py"},
            {"prompt": long_code.continue_user(other[:5000]), "source": "decode.py"},
            {"prompt": "What is 10 x 24?"}]  # fmt: skip
    data = tmp_path / "files.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    drafter = export_random_drafter(tmp_path / "drafter" / "export", 8)
    r = evaluate(EvalConfig(target=str(TINY_TARGET), drafter=drafter, data=str(data), max_new_tokens=16),
                 baseline=False)  # fmt: skip
    assert [s["source"] for s in r.samples] == ["decoder.py", "decoder.py", "decode.py", None]
    assert [s["prompt_tokens"] // 1024 for s in r.samples] == [1, 2, 2, 0]  # 1K-2K, 2K-4K twice, 0-1K
    assert [k for k, b in r.by_context.items() if "kept" in b] == ["2K-4K"]
    assert r.by_context["2K-4K"]["kept_prompts"] == 1  # decode.py's one prompt is its shortest
    assert r.by_context["2K-4K"]["kept"] == pytest.approx(r.samples[1]["tau"] / r.samples[0]["tau"])
    from cli.results import print_eval

    print_eval(r.to_dict())
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("2K-4K tokens")]
    assert f"keeps {r.by_context['2K-4K']['kept']:.0%} of its files' tau at their shortest" in line


def test_a_long_prompt_file_goes_through_eval_sets_with_tau_by_context(tmp_path, capsys):
    """A prompt file with a 5K-token prompt, on a target whose positions hold it: eval-sets' JSON
    has each run's figures by context length, which add up to the run's own, and the table a column
    a bucket. On the bundled target's 4,096 positions the same file's long prompt is rejected, and so
    is a second turn that would pass them, each with its reason; the rest is measured as before, and
    a file with nothing that fits is refused."""
    from cli.results import print_sets_table
    from dflash_cache.eval.sets import evaluation

    wide = wide_target(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(TINY_TARGET)
    code = (ROOT / "dflash_cache" / "generate" / "decoder.py").read_text()
    long_prompt = "Continue this Python file:\n```python\n" + code[:9000] + "```"
    first_turn = next(code[:n] for n in range(5000, 9000, 10) if prompt_tokens(tokenizer, code[: n + 10]) > 4000)
    second_turn = "Now explain each of those functions, one at a time, and say what could go wrong in it. " * 3
    own = tmp_path / "mine.jsonl"
    own.write_text("".join(json.dumps(r) + "\n" for r in (  # the first two name one source: `kept` at 4K-8K
        {"prompt": long_prompt, "source": "s"}, {"prompt": "What is 10 x 24?", "source": "s"},
        {"turns": [first_turn, second_turn]})))  # fmt: skip
    lengths = [prompt_tokens(tokenizer, long_prompt), prompt_tokens(tokenizer, "What is 10 x 24?"),
               prompt_tokens(tokenizer, first_turn)]  # fmt: skip
    assert 5000 <= lengths[0] <= 8192 - 16 and lengths[1] <= 1024 and 3900 < lengths[2] <= 4096 - 8

    drafter = export_random_drafter(tmp_path / "drafter" / "export", 8)
    r = evaluation(str(wide), {"drafter": drafter}, [str(own)], max_new_tokens=8, out=tmp_path / "eval.json")
    assert json.loads((tmp_path / "eval.json").read_text()) == r
    mine = r["sets"]["mine"]
    assert mine["rejected"] == [] and mine["turn_prompts"] == 4
    for name in ("drafter", "prompt lookup"):
        run = mine["runs"][name]
        by = run["by_context"]
        assert list(by) == ["0-1K", "2K-4K", "4K-8K"] and [b["prompts"] for b in by.values()] == [1, 1, 2]
        assert sum(b["steps"] for b in by.values()) == run["steps"] > 0
        assert sum(b["tau"] * b["steps"] for b in by.values()) == pytest.approx(run["tau"] * run["steps"])
        assert sum(b["tau_per_prompt"] * b["prompts"] for b in by.values()) / 4 == pytest.approx(run["tau_per_prompt"])
    assert mine["runs"]["drafter"]["same_as_target"]  # the long prompt decodes the target's own output
    by = mine["runs"]["drafter"]["by_context"]
    # decoded at batch 1, each prompt is timed: each bucket's seconds (its tokens over its tok/s) add
    # up to the run's, less the time between prompts; prompt lookup is not decoded and has no speed
    seconds = sum(b["new_tokens"] / b["tok_s"] for b in by.values())
    assert 0.5 * mine["runs"]["drafter"]["seconds"] < seconds <= mine["runs"]["drafter"]["seconds"]
    assert all(b["ms_per_step"] > 0 and b["speedup"] == pytest.approx(b["tok_s"] / b["target_tok_s"])
               for b in by.values())  # fmt: skip
    assert "tok_s" not in mine["runs"]["prompt lookup"]["by_context"]["0-1K"]
    assert r["table"][0]["tau_by_context"] == {k: b["tau_per_prompt"] for k, b in by.items()}
    assert [k for k, b in by.items() if "kept" in b] == ["4K-8K"] and by["4K-8K"]["kept_prompts"] == 1
    print_sets_table(r)
    table = capsys.readouterr().out
    assert "by prompt length" in table and "4K-8K" in table and "0-1K" in table
    assert f"{by['4K-8K']['kept']:.0%}" in table

    sinks: list[RecordingSink] = []
    bundled = evaluation(str(TINY_TARGET), {"drafter": drafter}, [str(own)], max_new_tokens=8,
                         bars=lambda label: sinks.append(RecordingSink()) or sinks[-1])["sets"]["mine"]  # fmt: skip
    assert [(x["index"], x["turn"], x["prompt_tokens"], x["turns_left_out"]) for x in bundled["rejected"]] == [
        (0, 1, lengths[0], 1), (2, 2, bundled["rejected"][1]["prompt_tokens"], 1)]
    assert bundled["rejected"][0]["reason"] == (f"{lengths[0]:,} prompt tokens and --max-new-tokens 8 need "
                                                f"{lengths[0] + 8:,} positions, more than the target's 4,096 "
                                                "(max_position_embeddings)")  # fmt: skip
    assert bundled["rejected"][1]["prompt_tokens"] + 8 > 4096
    assert bundled["turn_prompts"] == 2
    run = bundled["runs"]["drafter"]
    wide_by = mine["runs"]["drafter"]["by_context"]  # the same weights and prompts: the same figures
    untimed = {"tok_s", "ms_per_step", "target_tok_s", "speedup"}  # the figures, not the seconds they took

    def figures_of(by: dict) -> dict:
        return {k: {f: v for f, v in b.items() if f not in untimed} for k, b in by.items()}

    assert figures_of(run["by_context"]) == figures_of({k: wide_by[k] for k in ("0-1K", "2K-4K")})
    assert run["turns"][0]["prompts"] == 2
    assert all(sink.totals["prompts"] == sink.started[0] for sink in sinks)  # the turns not asked count as done
    print_sets_table(r | {"sets": {"mine": bundled}})
    assert "2 rejected" in capsys.readouterr().out

    alone = tmp_path / "long.jsonl"
    alone.write_text(json.dumps({"prompt": long_prompt}) + "\n")
    with pytest.raises(DataError, match=f"{alone}: no prompt fits the target's positions: row 0 has {lengths[0]:,}"):
        evaluation(str(TINY_TARGET), {"drafter": drafter}, [str(alone)], max_new_tokens=8)


def test_long_code_prompts_are_cut_at_their_lengths_in_the_targets_tokens(tmp_path):
    """The same held-out modules at 1K, 2K, 4K and 7K tokens of the target's tokenizer (each the
    longest whole-line prefix that fits), those that leave 1,024 positions for the answer: all four
    on 8,192 positions, two on the bundled target's 4,096; without a target, at 4 characters a token."""
    tokenizer = AutoTokenizer.from_pretrained(TINY_TARGET)
    path, rows = benchsets.set_rows("long-code", long_code.Measure(str(wide_target(tmp_path))))
    assert path == str(STDLIB)
    texts = {f"stdlib/{p.relative_to(STDLIB).as_posix()}": p.read_text(encoding="utf-8") for p in STDLIB.rglob("*.py")
             if p.stat().st_size >= 30_000}  # fmt: skip
    modules = list(dict.fromkeys(r["source"] for r in rows))
    assert len(modules) >= 6 and all(held_out(module_of(m)) for m in modules)
    assert [(r["source"], r["length"]) for r in rows] == [(m, n) for m in modules for n in (1000, 2000, 4000, 7000)]
    head = long_code.CONTINUE_USER.split("{code}")[0]
    for r in rows:
        code = r["prompt"].removeprefix(head).removesuffix("```")
        text = texts[r["source"]]
        assert text.startswith(code) and code.endswith("\n")
        assert r["tokens"] == prompt_tokens(tokenizer, r["prompt"]) <= r["length"]
        longer = code + text[len(code) :].split("\n", 1)[0] + "\n"  # one more line does not fit
        assert prompt_tokens(tokenizer, long_code.continue_user(longer)) > r["length"]
        assert r["tokens"] >= 0.9 * r["length"]

    _, bundled = benchsets.set_rows("long-code", long_code.Measure(str(TINY_TARGET)))
    assert [(r["source"], r["length"], r["tokens"]) for r in bundled] == [
        (r["source"], r["length"], r["tokens"]) for r in rows if r["length"] <= 2000]
    _, estimated = benchsets.set_rows("long-code")  # no target: estimated
    assert [(r["source"], r["length"]) for r in estimated] == [(r["source"], r["length"]) for r in rows]
    assert all(r["tokens"] == math.ceil(len(r["prompt"]) / 4) <= r["length"] for r in estimated)


def test_long_code_reaches_30k_tokens_where_the_target_has_the_positions(tmp_path):
    """On 32,768 positions the set adds 16,000 and 30,000 tokens (the buckets 8K-16K and 16K-32K),
    each for the modules that hold more tokens than that, the shorter lengths' rows as on 8,192
    positions. On 8,192 positions (SmolLM2's) the set is today's: every module at 1K, 2K, 4K and 7K,
    each row the longest prefix that fits; without a target it is cut for 8,192 positions too, so
    `dflash sets` writes the rows it wrote."""
    measure = long_code.Measure(str(wide_target(tmp_path / "t8k")))
    _, rows = benchsets.set_rows("long-code", measure)
    root = STDLIB
    today = [{"prompt": long_code.continue_user(cut[0]), "source": source, "length": n, "tokens": cut[1]}
             for source, text in long_code.set_modules([("stdlib", root)]) for n in (1000, 2000, 4000, 7000)
             if (cut := long_code.prefix(text, n, measure))]  # fmt: skip
    assert rows == today and len(today) == 4 * len(long_code.set_modules([("stdlib", root)]))
    _, estimated = benchsets.set_rows("long-code")
    assert {r["length"] for r in estimated} == {1000, 2000, 4000, 7000} and len(estimated) == len(rows)

    wide = long_code.Measure(str(wide_target(tmp_path / "t32k", 32768)))
    _, long_rows = benchsets.set_rows("long-code", wide)
    assert [r for r in long_rows if r["length"] <= 7000] == rows
    texts = dict(long_code.set_modules([("stdlib", root)]))
    modules = list(texts)
    for n, bucket in ((16000, "8K-16K"), (30000, "16K-32K")):
        at = [r for r in long_rows if r["length"] == n]
        assert at, f"no module holds {n:,} tokens"
        holds = [m for m in modules if wide.tokens(long_code.continue_user(texts[m])) > n]
        assert [r["source"] for r in at] == holds  # every module that holds more, in the set's order
        for r in at:
            assert 0.9 * n <= r["tokens"] == wide.tokens(r["prompt"]) <= n
            one = {"prompt_tokens": r["tokens"], "new_tokens": 1, "acceptance_lengths": [1]}
            assert list(context_figures([one])) == [bucket]
    assert len({r["source"] for r in long_rows if r["length"] == 30000}) < len(modules)
    order = [(r["source"], r["length"]) for r in long_rows]
    assert order == sorted(order, key=lambda x: (modules.index(x[0]), x[1]))  # module by module, lengths in order


class CountingMeasure(long_code.Measure):
    """The target's own measure, counting the messages it tokenizes."""

    calls = 0

    def tokens(self, message: str) -> int:
        self.calls += 1
        return super().tokens(message)


def test_long_code_takes_the_held_out_modules_of_the_roots_it_is_given(tmp_path):
    """``--code-roots``: in a directory of real modules, long-code asks exactly the held-out ones that
    hold 36,000 characters (none of the training side's), named by the directory and cut as the
    standard library's are; eval-sets with ``--limit`` cuts only the rows it evaluates, and records
    the roots; a root with no such module is refused with its reason, as is one that is no
    directory (by ``dflash sets`` too)."""
    from dflash_cache.eval.sets import evaluation

    held = long_code.set_modules([("stdlib", STDLIB)])[:3]
    trained = [(n, p) for n, p in code_prompts.source_files([("stdlib", STDLIB)])
               if p.stat().st_size >= 40_000 and "/" not in n.removeprefix("stdlib/")][:3]  # fmt: skip
    lib = tmp_path / "lib"
    for name, _ in held + trained:
        rel = name.removeprefix("stdlib/")
        (lib / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(STDLIB / rel, lib / rel)
    assert len(trained) == 3 and len(held) == 3

    wide = wide_target(tmp_path)
    source, rows = benchsets.set_rows("long-code", long_code.Measure(str(wide)), [str(lib)])
    _, stdlib_rows = benchsets.set_rows("long-code", long_code.Measure(str(wide)))
    assert source == str(lib)
    assert rows == [r | {"source": r["source"].replace("stdlib/", "lib/", 1)} for r in stdlib_rows
                    if r["source"] in dict(held)]  # fmt: skip
    assert [m for m in dict.fromkeys(r["source"] for r in rows)] == [n.replace("stdlib/", "lib/") for n, _ in held]

    full, limited = CountingMeasure(str(wide)), CountingMeasure(str(wide))
    assert benchsets.set_rows("long-code", full, [str(lib)])[1] == rows
    assert benchsets.set_rows("long-code", limited, [str(lib)], limit=2)[1] == rows[:2]
    assert limited.calls < full.calls / 2  # the first module's rows only: the others are not cut

    drafter = export_random_drafter(tmp_path / "drafter" / "export", 8)
    r = evaluation(str(wide), {"drafter": drafter}, ["long-code"], max_new_tokens=4, limit=2,
                   code_roots=[str(lib)], lookup=[0])  # fmt: skip
    one = r["sets"]["long-code"]
    assert r["code_roots"] == [str(lib)] and one["source"] == str(lib) and one["rows"] == 2
    assert one["prompts"] == 2 and list(one["runs"]["drafter"]["by_context"]) == ["0-1K", "1K-2K"]

    (tmp_path / "none").mkdir()
    shutil.copyfile(STDLIB / trained[0][0].removeprefix("stdlib/"), tmp_path / "none" / "only.py")
    with pytest.raises(DataError, match="no module on the held-out side of .*none holds 36,000 characters"):
        evaluation(str(wide), {"drafter": drafter}, ["long-code"], code_roots=[str(tmp_path / "none")])
    proc = subprocess.run([sys.executable, "-m", "cli.main", "sets", "--code-roots", str(tmp_path / "nowhere")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip() == (f"error: code prompt root '{tmp_path / 'nowhere'}': neither stdlib, "
                                   "site-packages nor a directory")  # fmt: skip


def test_no_held_out_module_enters_training(tmp_path):
    """The module split: its two sides are disjoint, each module on the side its hash says, about
    15% held out. Every long-code module is held out, and no code prompt and no long training row
    comes from a held-out module; a long training row is a proper prefix of its file, of a length
    between its bounds, from a file that defines no HumanEval function."""
    roots = [("stdlib", STDLIB)]
    train = dict(code_prompts.source_files(roots))
    held = dict(code_prompts.source_files(roots, held_out=True))
    assert not train.keys() & held.keys()
    assert all(held_out(module_of(n)) for n in held) and not any(held_out(module_of(n)) for n in train)
    assert 0.10 < len(held) / (len(train) + len(held)) < 0.20

    long_eval = {module_of(r["source"]) for r in benchsets.set_rows("long-code")[1]}
    assert long_eval and all(held_out(m) for m in long_eval)
    code_prompts.build(tmp_path / "code.jsonl", roots=["stdlib"])
    code = [json.loads(x) for x in (tmp_path / "code.jsonl").read_text(encoding="utf-8").split("\n") if x]
    assert len(code) > 6000 and not any(held_out(module_of(r["source"])) for r in code)
    assert not {module_of(r["source"]) for r in code} & long_eval

    measure = long_code.Measure(str(TINY_TARGET))
    rows = long_code.training_rows(12, ["stdlib"], measure, 2000, 3000, seed=1)
    defines = benchsets.humaneval_definitions()
    assert len(rows) == 12 and len({r["source"] for r in rows}) == 12
    head = long_code.CONTINUE_USER.split("{code}")[0]
    for r in rows:
        assert not held_out(module_of(r["source"])) and module_of(r["source"]) not in long_eval
        text = (STDLIB / r["source"].split("/", 1)[1]).read_text(encoding="utf-8")
        code = r["prompt"].removeprefix(head).removesuffix("```")
        assert text.startswith(code) and len(code) < len(text.rstrip()) and not defines.search(text)
        assert 2000 <= r["tokens"] == measure.tokens(r["prompt"]) <= r["length"] <= 3000
    assert long_code.training_rows(5, ["stdlib"], measure, 2000, 3000, seed=1) == rows[:5]  # the first N whatever N


def load_code_target_script():
    """data/make_code_target.py, imported (a script of data/, not a package module)."""
    if str(ROOT / "data") not in sys.path:
        sys.path.insert(0, str(ROOT / "data"))
    import make_code_target

    return make_code_target


# A standard library in miniature: the training side, a HELD_OUT module, long-code's eval side (three of
# the set's modules, a package's submodule among them, and a short one), tests of each side.
MINI_STDLIB = {
    "train": ["bisect.py", "colorsys.py", "queue.py", "sched.py", "xml/__init__.py", "xml/dom/__init__.py"],
    "held_out": ["shlex.py"],
    "eval_side": ["functools.py", "socket.py", "fnmatch.py", "xml/dom/minidom.py"],
}
TOY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
       "num_key_value_heads": 1, "head_dim": 16}  # fmt: skip


def test_the_long_code_target_holds_out_every_long_code_module(tmp_path):
    """``make_code_target.py --size long`` at toy scale (2 steps, 1,024-token batches, a toy geometry)
    on CPU: a Qwen3 with 32,768 positions whose training left out HELD_OUT and every file of
    long-code's side of the module split (its test files too), as corpus.json records; on the real
    standard library, every module the long-code set asks is held out."""
    script = load_code_target_script()
    files = script.stdlib_files(STDLIB, True)
    held, modules = script.long_code_split(files)
    train, _ = script.split_corpus(files, held)
    asked = {s.removeprefix("stdlib/") for s, _ in long_code.set_modules([("stdlib", STDLIB)])}
    assert asked and asked <= held and not asked & {p for p, _ in train}
    assert all(held_out(m) for m in modules) and not any(held_out(module_of(f"stdlib/{p}")) for p, _ in train
                                                         if not script.is_test(Path(p)))  # fmt: skip

    root = tmp_path / "stdlib"
    for rel in [p for side in MINI_STDLIB.values() for p in side]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(STDLIB / rel, root / rel)
    (root / "test").mkdir()
    (root / "test" / "test_functools.py").write_text("import functools\n\n\ndef test_cache():\n    assert functools\n")
    (root / "test" / "test_queue.py").write_text("import queue\n\n\ndef test_queue():\n    assert queue.Queue()\n")
    out = tmp_path / "long-target"
    subprocess.run([sys.executable, str(ROOT / "data" / "make_code_target.py"), "--size", "long", "--out", str(out),
                    "--stdlib", str(root), "--steps", "2", "--batch-tokens", "1024", "--geometry", json.dumps(TOY)],
                   check=True, capture_output=True, timeout=300)  # fmt: skip

    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == 32768 and config["hidden_size"] == 32
    corpus = json.loads((out / "corpus.json").read_text())
    held_paths = set(corpus["files"]["held_out_paths"])
    set_paths = {s.removeprefix("stdlib/") for s, _ in long_code.set_modules([("stdlib", root)])}
    assert set_paths == {"functools.py", "socket.py", "xml/dom/minidom.py"} and set_paths <= held_paths
    split = set(MINI_STDLIB["eval_side"]) | {"test/test_functools.py"}
    assert set(corpus["long_code_split"]["paths"]) == split
    assert held_paths == split | set(MINI_STDLIB["held_out"])
    assert corpus["files"]["train"] == len(MINI_STDLIB["train"]) + 1  # test_queue.py is trained on
    assert corpus["whole_modules"]["longest"] == 1024 and corpus["whole_modules"]["train"] > 0
    sources = {json.loads(x)["source"] for x in (out / "code_train.jsonl").read_text().splitlines()}
    assert sources and not sources & held_paths
