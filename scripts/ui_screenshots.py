"""Retake the web view's screenshots in docs/images/ with headless Chromium (docs/web-view.md).

It starts `orchestra serve` on a family (the bundled one in ``--home``, or with ``--tiny`` a family home
whose members derive from a tiny llama model, built in seconds, as scripts/smoke_demo.py builds it),
with the demo pipeline in its ``--pipelines`` folder; opens http://127.0.0.1:PORT/ui in Chromium; starts
a run from the page over the start of the demo's document; and saves two PNGs: the run while it runs
(some agents done, others streaming their tokens) and the finished run with a mapped agent's gates
open.

    python scripts/ui_screenshots.py [--home DIR | --tiny] [--chars 6000] [--out docs/images]

Needs the `serve` extra, selenium (the `dev` extra) and Chromium with chromedriver
(`apt-get install chromium chromium-driver`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "long_document_analysis"
RUNNING_PNG = "web-view-running.png"
FINISHED_PNG = "web-view-finished.png"
WIDTH = 1500


def start_server(home: Path, pipelines: Path, tiny: bool, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    from orchestra.serve import ServerStartError
    from orchestra.serve import start_server as launch

    args = ["--home", str(home), "--device", "cpu", "--pipelines", str(pipelines), "--log-format", "console"]
    if tiny:  # a fresh tiny home has no mappings: calibrate them in the run (seconds on tiny models)
        args += ["--on-missing-mapping", "calibrate"]
    try:
        server = launch(args, log=log, cwd=ROOT)
    except ServerStartError as exc:
        raise SystemExit(str(exc)) from None
    return server.process, server.base_url


def open_browser() -> WebDriver:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver = shutil.which("chromium") or shutil.which("google-chrome"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        raise SystemExit("needs Chromium and chromedriver: apt-get install chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={WIDTH},1000", "--hide-scrollbars", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


def screenshot(driver: WebDriver, path: Path) -> None:
    """The whole page (the window grown to its height), as a PNG."""
    height = int(driver.execute_script("return document.documentElement.scrollHeight"))
    driver.set_window_size(WIDTH, min(max(height + 20, 900), 4000))
    time.sleep(0.5)  # one more frame for the resized layout (a picture, not a test)
    path.write_bytes(driver.get_screenshot_as_png())
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}", flush=True)


def take(base: str, text: str, out: Path, timeout: float) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    driver = open_browser()
    try:
        driver.get(f"{base}/ui/")
        wait = WebDriverWait(driver, 60, poll_frequency=0.2)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, '#pipeline option[value="pipeline"]'))
        Select(driver.find_element(By.ID, "pipeline")).select_by_value("pipeline")
        driver.execute_script("arguments[0].value = arguments[1]", driver.find_element(By.ID, "document"), text)
        driver.find_element(By.ID, "start").click()
        long_wait = WebDriverWait(driver, timeout, poll_frequency=0.2)
        def ended(d: WebDriver) -> bool:
            return d.find_element(By.ID, "run-status").get_attribute("data-status") not in ("running", None, "")

        long_wait.until(lambda d: ended(d) or (d.find_elements(By.CSS_SELECTOR, '#dag g.node[data-state="succeeded"]')
                                               and d.find_elements(By.CSS_SELECTOR, '#dag g.node[data-state="running"]')))
        screenshot(driver, out / RUNNING_PNG)
        long_wait.until(ended)
        if driver.find_element(By.ID, "run-status").get_attribute("data-status") != "succeeded":
            raise SystemExit(f"the run did not succeed: {driver.find_element(By.ID, 'run-error').text}")
        mapped = driver.find_elements(By.CSS_SELECTOR, '#dag g.node[data-path="mapped"]')
        (mapped or driver.find_elements(By.CSS_SELECTOR, "#dag g.node[data-state]"))[0].click()
        WebDriverWait(driver, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#cache-body [data-document]"))
        screenshot(driver, out / FINISHED_PNG)
    finally:
        driver.quit()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--home", type=Path, help="the family home (default: $ORCHESTRA_HOME or ~/.cache/orchestra)")
    where.add_argument("--tiny", action="store_true", help="a tiny family built in a temporary folder (seconds)")
    parser.add_argument("--chars", type=int, help="characters of the demo's document to run over (default: 6000, "
                        "1500 with --tiny, whose byte-level tokenizer makes about one token of each)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images", help="folder for the PNGs")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds the run may take")
    args = parser.parse_args(argv)

    scratch = Path(tempfile.mkdtemp(prefix="orchestra-ui-shots-"))
    try:
        if args.tiny:
            sys.path.insert(0, str(ROOT / "scripts"))
            from smoke_demo import build_tiny_home

            home = build_tiny_home(scratch)
        else:
            from orchestra.paths import resolve_home

            home = resolve_home(args.home)
        pipelines = scratch / "pipelines"
        pipelines.mkdir()
        shutil.copy(EXAMPLE / "pipeline.yaml", pipelines / "pipeline.yaml")
        chars = args.chars or (1500 if args.tiny else 6000)
        text = (EXAMPLE / "document.txt").read_text(encoding="utf-8")[:chars]
        args.out.mkdir(parents=True, exist_ok=True)
        process, base = start_server(home, pipelines, args.tiny, scratch / "server.log")
        try:
            take(base, text, args.out.resolve(), args.timeout)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(60)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("SE_OFFLINE", "true")  # selenium-manager never goes to the network
    raise SystemExit(main())
