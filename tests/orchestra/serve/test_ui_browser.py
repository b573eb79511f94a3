"""The web view (/ui) in a real Chromium, driven by selenium, against live servers on the tiny family.

`orchestra serve`'s app runs under uvicorn on a real 127.0.0.1 port (in a thread of this process, over a
ServeEngine on the tiny family whose root -> finetuned mapping is calibrated once for the module), and
`orchestra run --ui --ui-wait` runs as users run it, in a subprocess. Each browser test starts its run
from the page or the command, waits (polling the page, never sleeping against another process) until
the DAG's nodes have succeeded, checks that the agent on the source member is drawn `exact` and the one
on the other member `mapped`, and fails on any console error the page logged (level SEVERE).

Chromium and chromedriver come from the system (`apt-get install chromium chromium-driver`; .ci/run
installs them). Without them, or without selenium, these tests skip with the reason, except under
CI=true, where they fail: CI must not go green without having driven the browser.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from orchestra.family.corpus import data_text
from orchestra.familycache.mapping_store import MappingStore
from orchestra.serve import ServeEngine, create_app
from orchestra.serve._ui import RunView
from tests.orchestra.serve.conftest import ROOT, TinyServeFamily, tiny_engine

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.remote.webelement import WebElement

DOC = data_text("gpl-3.txt")[:300]
WAIT_S = 90.0  # an upper bound for a run of two 4-token agents on tiny models, never a measured expectation
KEY_ENV = "ORCHESTRA_UI_TEST_KEY"
GATE = "gate: {offline: null, probe: {tokens: 8, max_excess_nll: 100, max_excess_kl: 100}}\n"
AGENTS = ("agents:\n"
          "  - {name: summary, model: r, spec: {task: Summarise., generation: {max_new_tokens: 4}}}\n"
          "  - {name: check, model: f, upstream: [summary], spec: {task: 'Check {summary}', "
          "generation: {max_new_tokens: 4}}}\n")


# -- the browser -------------------------------------------------------------------------------------------------------
def _chromium() -> tuple[str, str]:
    """(chromium, chromedriver) paths; a skip with the reason, or under CI=true a failure."""
    missing = []
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium (pip install -e '.[dev]')")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    if chromium is None:
        missing.append("chromium (apt-get install chromium)")
    if driver is None:
        missing.append("chromedriver (apt-get install chromium-driver)")
    if missing:
        message = "the web view's browser tests need " + ", ".join(missing)
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{message}; CI must drive a real browser (.ci/run installs Chromium)", pytrace=False)
        pytest.skip(message)
    assert chromium is not None and driver is not None
    return chromium, driver


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    chromium, driver_path = _chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # an explicit chromedriver: selenium-manager (which would go to the network) is never run
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    yield driver
    driver.quit()


@pytest.fixture
def page(browser: WebDriver) -> Iterator[WebDriver]:
    """The shared browser, its console log emptied first; left on a blank page, so nothing polls a closed server."""
    browser.get_log("browser")
    yield browser
    browser.get("about:blank")


def assert_no_console_errors(driver: WebDriver) -> None:
    """Every console message at level SEVERE (a JS error, a failed request) fails the test; then leave the page,
    so it stops polling before its server goes away."""
    errors = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    driver.get("about:blank")
    assert errors == [], f"the page logged console errors: {errors}"


def wait_for(driver: WebDriver, what: str, condition: Callable[[WebDriver], object]) -> object:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(condition, f"the page never showed {what}")


def node(driver: WebDriver, name: str) -> WebElement:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, f'#dag g.node[data-node="{name}"]')


def wait_succeeded(driver: WebDriver, *names: str) -> None:
    from selenium.webdriver.common.by import By

    selector = ", ".join(f'#dag g.node[data-node="{n}"][data-state="succeeded"]' for n in names)
    wait_for(driver, f"{', '.join(names)} succeeded",
             lambda d: len(d.find_elements(By.CSS_SELECTOR, selector)) == len(names))
    wait_for(driver, "the run succeeded",
             lambda d: d.find_element(By.ID, "run-status").get_attribute("data-status") == "succeeded")


def assert_exact_and_mapped(driver: WebDriver) -> None:
    """summary runs on the source member (its own cache), check on the other one (the source's cache mapped)."""
    from selenium.webdriver.common.by import By

    exact, mapped = node(driver, "summary"), node(driver, "check")
    assert exact.get_attribute("data-path") == "exact" and "path-exact" in (exact.get_attribute("class") or "")
    assert mapped.get_attribute("data-path") == "mapped" and "path-mapped" in (mapped.get_attribute("class") or "")
    assert mapped.find_element(By.CSS_SELECTOR, "text.path").text == "mapped"
    panel = driver.find_element(By.CSS_SELECTOR, '#node-panels .panel[data-node="check"]')
    assert panel.find_element(By.CSS_SELECTOR, ".chip.path").text == "mapped"
    assert int(panel.find_element(By.CSS_SELECTOR, ".tokens").get_attribute("data-tokens") or 0) >= 1


# -- live servers ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ui_family(tiny_serve_family: TinyServeFamily, tmp_path_factory: pytest.TempPathFactory) -> TinyServeFamily:
    """The tiny family with its root -> finetuned mapping calibrated (once, here), so a run maps instead of
    re-prefilling."""
    corpus = [("mpl", data_text("mpl-2.0.txt")[:6000]), ("apache", data_text("apache-2.0.txt")[:6000])]
    store = MappingStore(tmp_path_factory.mktemp("ui_maps"), tokens=2048, corpus=corpus)
    registry = tiny_serve_family.registry
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "calibrating on demand" is the point here
        store.get(registry.load("root"), registry.load("finetuned"))
    return TinyServeFamily(tiny_serve_family.manifest, registry, store)


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("ui_pipelines")
    (folder / "mixed.yaml").write_text("name: ui-mixed\nmodels: {r: root, f: finetuned}\nsource: r\n" + GATE + AGENTS)
    (folder / "ask.yaml").write_text(
        "models: {root: root}\ninputs: {question: {default: 'Who may copy it?'}}\n"
        "agents:\n  - {name: answer, model: root, spec: {task: 'Answer: {question}', generation: {max_new_tokens: 3}}}\n")
    (folder / "broken.yaml").write_text("models: {r: root}\nagents: []\n")
    return folder


def serve(engine: ServeEngine) -> RunView:
    """The server's app on a free 127.0.0.1 port, under uvicorn on a thread of its own (as `run --ui` serves)."""
    view = RunView(create_app(engine=engine), 0)
    view.start()
    return view


@pytest.fixture
def server(ui_family: TinyServeFamily, pipelines: Path) -> Iterator[RunView]:
    engine = tiny_engine(ui_family, pipelines_dir=pipelines)
    view = serve(engine)
    yield view
    view.close()
    engine.close()


def start_from_the_page(driver: WebDriver) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    wait_for(driver, "the pipeline choice",
             lambda d: d.find_elements(By.CSS_SELECTOR, '#pipeline option[value="mixed"]'))
    Select(driver.find_element(By.ID, "pipeline")).select_by_value("mixed")
    driver.find_element(By.ID, "document").send_keys(DOC)
    driver.find_element(By.ID, "start").click()


# -- the tests ---------------------------------------------------------------------------------------------------------
def test_a_run_started_from_the_page_is_drawn_live_with_its_cache_paths(server: RunView, page: WebDriver) -> None:
    from selenium.webdriver.common.by import By

    page.get(server.url)
    start_from_the_page(page)
    wait_for(page, "the new run in the list", lambda d: d.find_elements(By.CSS_SELECTOR, "#runs li.selected"))
    wait_succeeded(page, "summary", "check")
    assert_exact_and_mapped(page)
    # the DAG's edge came from the pipeline's file: summary -> check, and the document feeds summary
    assert len(page.find_elements(By.CSS_SELECTOR, "#dag path.edge")) == 2
    node(page, "check").click()  # its gate verdicts and metrics
    detail = page.find_element(By.ID, "detail")
    wait_for(page, "check's gate verdict", lambda d: "pass" in detail.text)
    assert "excess_nll" in detail.text and "mapped" in detail.text
    metrics = page.find_element(By.ID, "run-metrics").text
    assert "prefill saved" in metrics and "first token" in metrics
    wait_for(page, "finetuned's mapped copy in the cache panel", lambda d: d.find_elements(
        By.CSS_SELECTOR, '#cache-body [data-member="finetuned"][data-kind="mapped"]'))
    assert page.find_elements(By.CSS_SELECTOR, '#cache-body [data-member="root"][data-kind="exact"]')
    assert_no_console_errors(page)


def test_with_an_api_key_the_page_asks_for_it_and_sends_it(page: WebDriver, ui_family: TinyServeFamily,
                                                           pipelines: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from selenium.webdriver.common.by import By

    monkeypatch.setenv(KEY_ENV, "s3cret-key")
    engine = tiny_engine(ui_family, pipelines_dir=pipelines, api_key_env=KEY_ENV)
    view = serve(engine)
    try:
        base = view.url.removesuffix("/ui/")
        assert httpx.get(f"{base}/v1/ui/runs").status_code == 401  # the routes keep the key
        assert httpx.get(view.url).status_code == 200 and httpx.get(f"{base}/ui/config.json").json()["auth"] is True
        page.get(view.url)
        banner = page.find_element(By.ID, "banner")
        wait_for(page, "the key prompt", lambda d: "needs an API key" in banner.text)
        page.find_element(By.ID, "api-key").send_keys("s3cret-key")
        page.find_element(By.ID, "save-key").click()
        start_from_the_page(page)
        wait_succeeded(page, "summary", "check")
        assert_exact_and_mapped(page)
        assert page.execute_script("return localStorage.getItem('orchestra.apiKey')") == "s3cret-key"
        assert_no_console_errors(page)
    finally:
        page.get("about:blank")
        view.close()
        engine.close()


def test_the_view_s_json_routes_and_files(server: RunView) -> None:
    """No browser: the page's files are served (and packaged), the routes it reads answer typed JSON."""
    base = server.url.removesuffix("/ui/")
    redirect = httpx.get(f"{base}/ui")
    assert redirect.status_code in (307, 308) and redirect.headers["location"].endswith("/ui/")
    for name, kind in (("", "text/html"), ("app.js", "javascript"), ("style.css", "text/css"),
                       ("vendor/dagre.min.js", "javascript")):
        answer = httpx.get(server.url + name)
        assert answer.status_code == 200 and kind in answer.headers["content-type"], name
    listed = {p["name"]: p for p in httpx.get(f"{base}/v1/pipelines").json()["data"]}
    assert sorted(listed) == ["ask", "broken", "mixed"] and listed["broken"]["error"]
    mixed = {n["name"]: n for n in listed["mixed"]["nodes"]}
    assert mixed["check"]["upstream"] == ["summary"] and mixed["check"]["member"] == "finetuned"
    assert listed["ask"]["inputs"] == [{"name": "question", "description": "", "default": "Who may copy it?"}]
    assert httpx.get(f"{base}/v1/ui/runs").json() == {"object": "list", "data": []}
    cache = httpx.get(f"{base}/v1/cache").json()
    assert cache["documents"] == [] and cache["run_caches"] == {"exact": 0, "mapped": 0, "reprefilled": 0}
    assert httpx.get(f"{base}/ui/nope.js").status_code == 404


# -- `orchestra run --ui` ----------------------------------------------------------------------------------------------
def _run_pipeline_file(tmp_path: Path, ui_family: TinyServeFamily) -> tuple[Path, Path]:
    """The mixed pipeline over the tiny model folders, reading the module's calibrated mapping."""
    root, child = (ui_family.registry.info(m).path for m in ("root", "finetuned"))
    pipeline = tmp_path / "mixed.yaml"
    pipeline.write_text(f"name: ui-mixed\nmodels: {{r: '{root}', f: '{child}'}}\nsource: r\ndefault_device: cpu\n"
                        f"mapping: {{directory: '{ui_family.mappings.directory}', on_missing: refuse}}\n" + GATE + AGENTS)
    document = tmp_path / "doc.txt"
    document.write_text(DOC)
    return pipeline, document


def _lines(process: subprocess.Popen[str]) -> queue.Queue[str]:
    """The command's output lines as they come (read on a thread, so waiting for one can time out)."""
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put("")  # EOF

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _line_with(lines: queue.Queue[str], text: str, seen: list[str]) -> str:
    while True:
        line = lines.get(timeout=WAIT_S)
        seen.append(line)
        assert line, f"the command ended before printing {text!r}:\n{''.join(seen)}"
        if text in line:
            return line


def test_orchestra_run_ui_shows_the_run_live_and_serves_until_ctrl_c(page: WebDriver, ui_family: TinyServeFamily,
                                                                     tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    pipeline, document = _run_pipeline_file(tmp_path, ui_family)
    cmd = [sys.executable, "-m", "orchestra", "run", str(pipeline), "--document", str(document), "--home",
           str(tmp_path / "home"), "--no-kv-store", "--ui", "--ui-wait"]
    process = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "COLUMNS": "200"})
    seen: list[str] = []
    try:
        lines = _lines(process)
        url = _line_with(lines, "web view: http://127.0.0.1:", seen).split("web view: ", 1)[1].split()[0]
        page.get(url)
        wait_succeeded(page, "summary", "check")
        assert_exact_and_mapped(page)
        assert not page.find_element(By.ID, "start-section").is_displayed()  # one run: nothing to start here
        _line_with(lines, "the web view stays at", seen)  # the run is over, the view still serves
        assert httpx.get(url).status_code == 200
        assert_no_console_errors(page)
        process.send_signal(signal.SIGINT)
        assert process.wait(WAIT_S) == 0, "".join(seen)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_orchestra_run_ui_without_wait_exits_when_the_run_does(ui_family: TinyServeFamily, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from orchestra.cli import app

    pipeline, document = _run_pipeline_file(tmp_path, ui_family)
    done = CliRunner().invoke(app, ["run", str(pipeline), "--document", str(document), "--home",
                                    str(tmp_path / "home"), "--no-kv-store", "--ui"])
    assert done.exit_code == 0, done.output
    url = done.output.split("web view: ", 1)[1].split()[0]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/ui/")
    with pytest.raises(httpx.ConnectError):  # the view closed with the command
        httpx.get(url, timeout=5)


def test_a_taken_ui_port_is_exit_2_naming_the_fix(ui_family: TinyServeFamily, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from orchestra.cli import app

    pipeline, document = _run_pipeline_file(tmp_path, ui_family)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        done = CliRunner().invoke(app, ["run", str(pipeline), "--document", str(document), "--home",
                                        str(tmp_path / "home"), "--no-kv-store", "--ui", "--ui-port",
                                        str(taken.getsockname()[1])])
    assert done.exit_code == 2 and "pick another port, or 0 for a free one" in done.output, done.output


@pytest.mark.parametrize("args, fix", [(["--ui-wait"], "--ui-wait only applies to the web view: add --ui"),
                                       (["--ui-port", "8123"], "--ui-port only applies to the web view: add --ui")])
def test_a_ui_option_without_ui_is_exit_2_naming_the_fix(tmp_path: Path, args: list[str], fix: str) -> None:
    from typer.testing import CliRunner

    from orchestra.cli import app

    (tmp_path / "p.yaml").write_text("models: {r: root}\nagents:\n  - {name: a, model: r, builtin: summarizer}\n")
    (tmp_path / "doc.txt").write_text(DOC)
    done = CliRunner().invoke(app, ["run", str(tmp_path / "p.yaml"), "--document", str(tmp_path / "doc.txt"), *args])
    assert done.exit_code == 2 and fix in done.output
    assert len([line for line in done.output.splitlines() if line.strip()]) == 1, done.output


@pytest.mark.real_model
def test_on_the_bundled_family_a_run_from_the_page_shows_its_exact_and_mapped_nodes(
        real_family, server_factory, pipelines: Path, page: WebDriver) -> None:
    """The same page against `orchestra serve` on the bundled SmolLM2 family (a subprocess, as users start it):
    the root's agent runs on its own cache, the fine-tuned member's on the root's cache mapped into it."""
    server = server_factory(real_family.home, "--pipelines", str(pipelines))
    page.get(f"{server.base_url}/ui/")
    start_from_the_page(page)
    wait_succeeded(page, "summary", "check")
    assert_exact_and_mapped(page)
    assert_no_console_errors(page)
