"""The answers file: survives processes and crashes, never loses or silently drops an answer."""
import json
import signal
import subprocess
import sys
import textwrap

from lablib.quiz.store import AnswerStore


def _python(code, *args, **kw):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], capture_output=True,
                          text=True, timeout=60, **kw)


def test_round_trip_across_processes(tmp_path):
    path = tmp_path / "quiz_answers.json"
    out = _python("""
        import sys
        from lablib.quiz.store import AnswerStore
        s = AnswerStore(sys.argv[1])
        s.record("fsdp/2", [1], True)
        s.record("fsdp/2", [0], False)
        s.record("welcome/waiting", 25.0, True)
    """, path)
    assert out.returncode == 0, out.stderr
    answers = AnswerStore(path).load()
    assert answers["fsdp/2"]["response"] == [0] and answers["fsdp/2"]["attempts"] == 2
    assert answers["welcome/waiting"]["response"] == 25.0


def test_default_path_is_next_to_the_notebook(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LABLIB_ANSWERS", raising=False)
    AnswerStore().record("a/1", [0], True)
    assert (tmp_path / "quiz_answers.json").exists()


def test_a_crash_mid_write_keeps_the_previous_answers(tmp_path):
    path = tmp_path / "quiz_answers.json"
    AnswerStore(path).record("fsdp/1", [0], True)
    before = path.read_text()
    # A writer killed after writing its temporary file, before the rename that publishes it.
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, sys, time
        from lablib.quiz.store import AnswerStore
        os.replace = lambda *a: (print("written", flush=True), time.sleep(60))
        AnswerStore(sys.argv[1]).record("fsdp/2", [1], True)
    """), str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "written"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert path.read_text() == before
    assert AnswerStore(path).load()["fsdp/1"]["response"] == [0]
    AnswerStore(path).record("fsdp/2", [1], True)  # and the lock was released with the process
    assert set(AnswerStore(path).load()) == {"fsdp/1", "fsdp/2"}


def test_a_damaged_file_is_kept_aside_not_overwritten(tmp_path, capsys):
    path = tmp_path / "quiz_answers.json"
    path.write_text('{"version": 1, "answers": {"fsdp/1": ')  # cut off
    store = AnswerStore(path)
    assert store.load() == {}
    kept = list(tmp_path.glob("quiz_answers.damaged-*.json"))
    assert len(kept) == 1 and kept[0].read_text() == '{"version": 1, "answers": {"fsdp/1": '
    assert "could not be read" in store.warning and kept[0].name in store.warning
    assert "could not be read" in capsys.readouterr().err
    store.record("fsdp/2", [1], True)
    assert json.loads(path.read_text())["answers"]["fsdp/2"]["response"] == [1]
    assert kept[0].exists()


def test_concurrent_writers_lose_nothing(tmp_path):
    path = tmp_path / "quiz_answers.json"
    writer = """
        import sys
        from lablib.quiz.store import AnswerStore
        s = AnswerStore(sys.argv[1])
        for i in range(40):
            s.record(f"{sys.argv[2]}/{i}", [i % 4], True)
    """
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(writer), str(path), name]) for name in "ab"]
    import threading

    from lablib.quiz.store import AnswerStore as Store
    threads = [threading.Thread(target=lambda n=n: [Store(path).record(f"{n}/{i}", [0], True) for i in range(20)])
               for n in "cd"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [p.wait(60) for p in procs] == [0, 0]
    answers = Store(path).load()
    assert len(answers) == 40 + 40 + 20 + 20


def test_a_record_keeps_its_first_attempt_its_place_and_a_revealed_answer(tmp_path):
    store = AnswerStore(tmp_path / "quiz_answers.json")
    store.record("fsdp/2", [0], False, where="02_collectives")
    rec = store.record("fsdp/2", [1], True, where="02_collectives")
    assert rec["response"] == [1] and rec["correct"] and rec["attempts"] == 2
    assert rec["first_response"] == [0] and rec["first_correct"] is False and rec["where"] == "02_collectives"
    rec = store.reveal("fsdp/2", where="02_collectives")
    assert rec["revealed"] is True and rec["attempts"] == 2 and rec["first_response"] == [0]
    shown_first = store.reveal("fsdp/3@quiz:fsdp", where="quiz:fsdp")  # shown before any answer
    assert "response" not in shown_first
    assert store.record("fsdp/3@quiz:fsdp", [2], True, where="quiz:fsdp")["revealed"] is True
    on_disk = json.loads((tmp_path / "quiz_answers.json").read_text())
    assert on_disk["version"] == 2 and set(on_disk["answers"]) == {"fsdp/2", "fsdp/3@quiz:fsdp"}


def test_exam_answers_are_saved_without_judging(tmp_path):
    store = AnswerStore(tmp_path / "quiz_answers.json")
    store.record("welcome/rank", [2], None, where="00_welcome")
    rec = store.record("welcome/rank", [0], None, where="00_welcome")
    assert rec == {"response": [0], "attempts": 2, "mode": "exam", "where": "00_welcome", "time": rec["time"]}


def test_an_old_record_is_updated_without_inventing_a_first_attempt(tmp_path):
    path = tmp_path / "quiz_answers.json"
    path.write_text(json.dumps({"version": 1, "answers": {
        "fsdp/2": {"response": [0], "correct": False, "attempts": 1, "time": "2025-01-01T00:00:00"},
        "fsdp/3": "not a record"}}))
    store = AnswerStore(path)
    rec = store.record("fsdp/2", [1], True)
    assert rec["attempts"] == 2 and "first_response" not in rec
    assert store.record("fsdp/3", [2], True)["attempts"] == 1  # a junk record is replaced, not crashed on


def test_json_nested_too_deep_is_a_damaged_file(tmp_path):
    path = tmp_path / "quiz_answers.json"
    path.write_text('{"answers": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert AnswerStore(path).load() == {}
    assert list(tmp_path.glob("quiz_answers.damaged-*.json"))
