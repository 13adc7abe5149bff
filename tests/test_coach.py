"""doit coach: the builds in a browser, driven by Playwright (pinned in the test extra) in Debian's
chromium (.ci/run installs it), with JavaScript off: a person goes from the catalogue to a recipe,
its report, its dropped rows and a diff of two builds, and every number on the pages is the one
the artifacts hold; nothing is fetched from anywhere but the Coach."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import NO_NETWORK, doit, free_port

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


def pointer(project: Path, stage: str) -> dict:
    return json.loads((project / "artifacts" / "tiny" / f"{stage}.json").read_text())


def stored(project: Path, stage: str, rel: str):
    return json.loads((project / "artifacts" / "store" / stage / pointer(project, stage)["key"] / rel).read_text())


@pytest.fixture(scope="module")
def history(built, tmp_path_factory) -> tuple[Path, str, str]:
    """tiny built twice (eval.limit 48, then 24) with its report: (project, first and second manifest keys)."""
    project = tmp_path_factory.mktemp("coach") / "proj"
    shutil.copytree(built, project, symlinks=True)
    first = pointer(project, "manifest")["key"]
    recipe = project / "recipes" / "tiny.yaml"
    recipe.write_text(recipe.read_text().replace("limit: 48", "limit: 24"))
    run = doit(project, "report:tiny")
    assert run.rc == 0 and run.stages_ran() == {"eval", "manifest", "report"}, run.out[-3000:]
    return project, first, pointer(project, "manifest")["key"]


@pytest.fixture(scope="module")
def coach(history):
    project = history[0]
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "doit", "coach", "--port", str(port)], cwd=project,
                            env={**__import__("os").environ, **NO_NETWORK, "NO_PROXY": "127.0.0.1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(url + "/", timeout=1)
            break
        except OSError:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
    yield url
    proc.terminate()
    assert proc.wait(timeout=30) == 0


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, coach, tmp_path):
    """A page with JavaScript off whose every request not to the Coach is refused and recorded."""
    context = browser.new_context(java_script_enabled=False)
    elsewhere = []

    def only_the_coach(route):
        if route.request.url.startswith(coach + "/"):
            route.continue_()
        else:
            elsewhere.append(route.request.url)
            route.abort()

    context.route("**/*", only_the_coach)
    page = context.new_page()
    yield page
    page.screenshot(path=str(tmp_path / "last.png"), full_page=True)
    context.close()
    assert elsewhere == [], elsewhere


def shown(value) -> str:
    """A number as the Coach prints it: a float to 4 significant digits, an integer whole."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def cells(page, selector: str) -> list[list[str]]:
    return [[c.inner_text().strip() for c in row.query_selector_all("td")] for row in page.query_selector_all(f"{selector} tr")
            if row.query_selector("td")]


def test_the_catalogue_lists_every_recipe_with_its_whole_description(page, coach, history):
    project = history[0]
    page.goto(coach + "/")
    rows = {r[0]: r for r in cells(page, "#catalogue")}
    names = sorted(p.stem for p in (project / "recipes").glob("*.yaml"))
    assert sorted(rows) == names
    for name in names:
        text = (project / "recipes" / f"{name}.yaml").read_text().splitlines()
        leading = " ".join(filter(None, (line.lstrip("#").strip() for line in
                                         text[:next(i for i, line in enumerate(text) if not line.startswith("#"))])))
        assert rows[name][1] == leading, name  # whole, not cut
    assert rows["tiny"][3:6] == ["sft", "cpu", "-"]
    assert rows["tiny_lora"][3] == "sft + lora"
    assert rows["qwen3_8b"][4:6] == ["h100", "30 GiB"]  # the GPU memory the recipe states


def test_a_recipe_page_shows_its_status_stages_and_builds_as_the_store_has_them(page, coach, history):
    project, first, second = history
    page.goto(coach + "/")
    page.click("#recipe-tiny a")
    assert page.url == coach + "/recipes/tiny"
    assert "manifest   up to date" in page.inner_text("#status")
    for stage in ("base", "plan", "shards", "checkpoint", "quantized", "eval", "manifest", "report"):
        row = page.query_selector(f"#stage-{stage}")
        assert row.query_selector(".key").inner_text() == pointer(project, stage)["key"]
        assert row.query_selector(".digest").inner_text() == pointer(project, stage)["digest"]
    assert "not built" in page.query_selector("#stage-anchor .key").inner_text()
    builds = cells(page, "#builds")
    assert [b[3] for b in builds] == [first, second]
    assert "(current)" in builds[1][2] and "(current)" not in builds[0][2]
    trained = stored(project, "eval", "eval.json")["trained"]
    assert builds[1][5:] == [shown(trained[m]) for m in sorted(trained)]

    page.click("nav >> text=report")
    assert page.inner_text("#manifest-digest") == pointer(project, "manifest")["digest"]


def test_two_builds_compare_inputs_stages_and_scores(page, coach, history):
    project, first, second = history
    page.goto(coach + "/recipes/tiny")
    page.check(f"input[name=a][value='{first}']")
    page.check(f"input[name=b][value='{second}']")
    page.click("button:text('compare')")
    assert page.url == f"{coach}/recipes/tiny/diff?a={first}&b={second}"
    assert page.inner_text("#inputs") == "recipe eval.limit (48 -> 24)"
    rebuilt = {r[0]: r[1] for r in cells(page, "#rebuilt")}
    assert rebuilt == {"base": "reused", "plan": "reused", "shards": "reused", "checkpoint": "reused",
                       "quantized": "reused", "eval": "rebuilt"}
    a = json.loads((project / "artifacts" / "store" / "manifest" / first / "manifest.json").read_text())["eval"]
    b = json.loads((project / "artifacts" / "store" / "manifest" / second / "manifest.json").read_text())["eval"]
    for model, metric, before, after, change in cells(page, "#scores"):
        if model in ("base", "trained"):
            assert before == shown(a[model][metric]) and after == shown(b[model][metric])
            assert change == shown(b[model][metric] - a[model][metric])


def test_dropped_rows_are_searched_by_reason_and_text(page, coach, history):
    project = history[0]
    stats = stored(project, "shards", "stats.json")
    page.goto(coach + "/recipes/tiny/dropped")
    assert page.inner_text("#matches").startswith(f"{sum(stats['dropped'].values())} matching rows")
    reason = max(stats["dropped"], key=stats["dropped"].get)
    page.select_option("select[name=reason]", reason)
    page.click("button:text('search')")
    assert page.inner_text("#matches").startswith(f"{stats['dropped'][reason]} matching rows")
    assert {r[2] for r in cells(page, "#dropped")} == {reason}
    page.fill("input[name=q]", "no row holds this")
    page.click("button:text('search')")
    assert page.inner_text("#matches").startswith("0 matching rows")


def test_a_served_model_is_linked_while_it_is_served(page, coach, history):
    project = history[0]
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "doit", "serve:tiny", "--port", str(port)], cwd=project,
                             env={**__import__("os").environ, **NO_NETWORK}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                assert serve.poll() is None, serve.stdout.read()
                time.sleep(0.2)
        page.goto(coach + "/recipes/tiny")
        digest = pointer(project, "manifest")["digest"]
        assert page.inner_text("#served") == f"served now as tiny-{digest[:12]} at http://127.0.0.1:{port}/v1"
    finally:
        serve.terminate()
        assert serve.wait(timeout=60) == 0
    assert not (project / "artifacts" / "tiny" / "serving.json").exists()
    page.goto(coach + "/recipes/tiny")
    assert page.query_selector("#served") is None


def test_the_coach_is_read_only_and_refuses_what_is_not_a_recipe_or_a_build(coach, history):
    import urllib.error

    for path, status in (("/recipes/nope", 404), ("/recipes/tiny/diff?a=..&b=../x", 404),
                         ("/recipes/..%2F..%2Fetc", 404)):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(coach + path, timeout=10)
        assert e.value.code == status, path
    request = urllib.request.Request(coach + "/recipes/tiny", method="POST", data=b"")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=10)
    assert e.value.code == 405
    assert re.search(r"default-src 'self'", urllib.request.urlopen(coach + "/", timeout=10).headers["Content-Security-Policy"])
