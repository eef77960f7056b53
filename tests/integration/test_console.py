"""The operator console (services/gateway/http/console/) in a real browser: headless
Chromium (Debian's, `make browser`) driven by Selenium, against a real server on the real
model. Log in through the form, watch a running request appear and cancel it from the page
(the client's stream ends `cancelled`), chat in the playground, screenshot the console under
load, load and unload a LoRA adapter, see a killed process's restart, and swap the model
from the page until the new version shows.

Every wait is for a state of the page (WebDriverWait) or of the client, with a deadline.
`SHUTTLE_CONSOLE_SCREENSHOT=PATH` also copies the screenshot there (docs/console.png)."""

from __future__ import annotations

import os
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import Select, WebDriverWait

from common.config import Config
from common.prepare_model import default_model_dir
from common.topology import process_names
from tests.lora_adapters import make_adapter
from tests.server import Server, running_server
from tests.waiting import wait_until

TOKEN = "console-admin"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
DEADLINE_S = 120.0  # for anything the page shows; a busy machine is only slower


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random PEFT LoRA adapter of the served model."""
    return make_adapter(default_model_dir(), tmp_path_factory.mktemp("lora") / "console-lora")


@pytest.fixture(scope="module")
def server(adapter: Path) -> Iterator[Server]:
    flags = (
        "--admin-token",
        TOKEN,
        "--max-num-seqs",
        "16",
        "--enable-lora",
        "--max-lora-rank",
        "8",
    )
    with running_server(*flags) as s:
        yield s


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    assert not missing, f"no {missing}: `make browser` installs Debian's chromium"
    options = Options()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.add_argument("--window-size=1440,2000")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def console(server: Server, browser: WebDriver) -> WebDriver:
    """The console, logged in through its form (without a session /console sends there)."""
    browser.get(server.url + "/console")
    wait = WebDriverWait(browser, DEADLINE_S)
    token = wait.until(ec.visibility_of_element_located((By.ID, "token")))
    assert browser.current_url.endswith("/console/login")
    token.send_keys("not-the-token")
    browser.find_element(By.ID, "login").click()
    wait.until(ec.text_to_be_present_in_element((By.ID, "login-error"), "invalid"))
    token.clear()
    token.send_keys(TOKEN)
    browser.find_element(By.ID, "login").click()
    wait.until(ec.text_to_be_present_in_element((By.ID, "feed-state"), "live"))
    assert browser.current_url.endswith("/console")
    wait.until(ec.text_to_be_present_in_element((By.ID, "model-ready"), "ready"))
    return browser


class Stream:
    """One streaming completion on a thread: its finish reason once it ends."""

    def __init__(self, server: Server, request_id: str, max_tokens: int) -> None:
        self.finish: str | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        body = {
            "model": server.model,
            "prompt": "Write a very long story about a lighthouse keeper.",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        headers = {"X-Request-Id": request_id}
        self.thread = threading.Thread(target=self._run, args=(server, body, headers), daemon=True)
        self.thread.start()

    def _run(self, server: Server, body: dict, headers: dict[str, str]) -> None:
        try:
            with server.client(timeout=600) as c:
                with c.stream("POST", "/v1/completions", json=body, headers=headers) as r:
                    assert r.status_code == 200, r.read()
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            for choice in orjson.loads(line[6:]).get("choices") or ():
                                self.finish = choice.get("finish_reason") or self.finish
        except BaseException as e:  # the test thread reports it
            self.error = e
        finally:
            self.done.set()


def _row(request_id: str) -> tuple[str, str]:
    return (By.CSS_SELECTOR, f'#requests tr[data-request-id="{request_id}"]')


def _waiter(driver: WebDriver, timeout: float = DEADLINE_S) -> WebDriverWait:
    """A wait on the page that looks again when the page replaced what it found."""
    return WebDriverWait(driver, timeout, ignored_exceptions=[StaleElementReferenceException])


def _num_output_tokens(driver: WebDriver, request_id: str) -> int:
    return int(driver.find_element(*_row(request_id)).find_elements(By.TAG_NAME, "td")[5].text)


def test_a_running_request_shows_and_is_cancelled_from_the_page(
    server: Server, console: WebDriver
) -> None:
    wait = _waiter(console)
    stream = Stream(server, "console-long-1", max_tokens=2000)
    row = wait.until(ec.visibility_of_element_located(_row("console-long-1")))
    # tokens flow: the output count rises past zero while the page watches
    wait.until(lambda d: _num_output_tokens(d, "console-long-1") > 0)
    assert "console-long-1" in row.text
    console.find_element(*_row("console-long-1")).find_element(By.CSS_SELECTOR, "button").click()
    # the page says so at once (its button), the gateway ends the stream
    assert stream.done.wait(DEADLINE_S), "the stream did not end after the cancel"
    assert stream.error is None, stream.error
    assert stream.finish == "cancelled"
    wait.until(ec.invisibility_of_element_located(_row("console-long-1")))


def test_the_playground_streams_a_chat(console: WebDriver) -> None:
    wait = _waiter(console)
    max_tokens = console.find_element(By.ID, "chat-max-tokens")
    max_tokens.clear()
    max_tokens.send_keys("12")
    console.find_element(By.ID, "chat-temperature").clear()
    console.find_element(By.ID, "chat-temperature").send_keys("0")
    console.find_element(By.ID, "chat-input").send_keys("Say hello.")
    console.find_element(By.ID, "chat-send").click()
    reply = (By.CSS_SELECTOR, "#chat-log .msg.assistant .meta")
    wait.until(ec.text_to_be_present_in_element(reply, "output tokens"))
    meta = console.find_element(*reply).text
    assert meta.startswith(("stop", "length")) and "prompt" in meta, meta
    text = console.find_element(By.CSS_SELECTOR, "#chat-log .msg.assistant span").text
    assert text.strip()


def test_a_screenshot_under_load(server: Server, console: WebDriver, tmp_path: Path) -> None:
    wait = _waiter(console)
    streams = [Stream(server, f"load-{i}", max_tokens=1500) for i in range(6)]
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#requests tbody tr")) >= 4)
    # the plots have some minutes' worth to show: a few readings of a rate above zero
    wait.until(lambda d: _throughput(d) > 0 and _num_readings(d, "plot-throughput") >= 8)
    shot = tmp_path / "console.png"
    assert console.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("SHUTTLE_CONSOLE_SCREENSHOT"):
        shutil.copy(shot, os.environ["SHUTTLE_CONSOLE_SCREENSHOT"])
    for s in streams:  # no need to wait them out
        httpx.post(
            f"{server.url}/admin/cancel/load-{streams.index(s)}",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=30,
        )
    wait_until(lambda: all(s.done.is_set() for s in streams), DEADLINE_S, "the load's end")
    assert all(s.error is None for s in streams)


def _num_readings(driver: WebDriver, plot: str) -> int:
    return int(driver.find_element(By.ID, plot).get_attribute("data-points") or 0)


def _throughput(driver: WebDriver) -> float:
    legend = driver.find_element(By.CSS_SELECTOR, "#plot-throughput .legend").text
    try:
        return float(legend.partition(":")[2] or 0)
    except ValueError:  # "–": no reading yet
        return 0.0


def test_an_adapter_is_loaded_and_unloaded_from_the_page(console: WebDriver, adapter: Path) -> None:
    wait = _waiter(console)
    console.find_element(By.ID, "lora-name").send_keys("console-lora")
    console.find_element(By.ID, "lora-path").send_keys(str(adapter))
    console.find_element(By.ID, "lora-load").click()
    row = (By.CSS_SELECTOR, '#adapters tr[data-adapter="console-lora"]')
    wait.until(ec.visibility_of_element_located(row))
    wait.until(ec.text_to_be_present_in_element((By.ID, "lora-result"), "Success"))
    # the playground may chat with it: its name is among the models
    wait.until(
        lambda d: (
            "console-lora" in [o.text for o in Select(d.find_element(By.ID, "chat-model")).options]
        )
    )
    console.find_element(*row).find_element(By.CSS_SELECTOR, "button.unload").click()
    wait.until(ec.invisibility_of_element_located(row))


def test_a_restarted_process_shows_with_its_restart(server: Server, console: WebDriver) -> None:
    pid = next(pid for module, pid in server.children() if module == "services.detokenizer")
    os.kill(pid, signal.SIGKILL)
    row = (By.CSS_SELECTOR, '#processes tr[data-process="detokenizer"]')
    _waiter(console).until(
        lambda d: d.find_element(*row).find_elements(By.TAG_NAME, "td")[2].text == "1"
    )
    cells = [td.text for td in console.find_element(*row).find_elements(By.TAG_NAME, "td")]
    assert cells[3] == "-9"  # the exit code the supervisor saw: SIGKILL
    # every process of the server is listed, those that never died with 0 restarts
    config = Config.from_json((server.run_dir / "config.json").read_bytes())
    # (read at once: the panel is drawn again at every snapshot)
    rows = console.execute_script(
        "return [...document.querySelectorAll('#processes tr[data-process]')]"
        ".map((tr) => [tr.dataset.process, tr.cells[2].textContent])"
    )
    restarts = dict(rows)
    assert sorted(restarts) == sorted(process_names(config))
    assert {n: r for n, r in restarts.items() if r != "0"} == {"detokenizer": "1"}
    wait_until(server.serves, DEADLINE_S, "serving again after the restart")


def test_a_swap_from_the_page_shows_the_new_version(console: WebDriver) -> None:
    wait = _waiter(console, 300)  # a swap loads the whole model again
    console.find_element(By.ID, "swap-path").send_keys(str(default_model_dir()))
    console.find_element(By.ID, "swap-version").send_keys("console-v2")
    Select(console.find_element(By.ID, "swap-mode")).select_by_value("drain")
    console.find_element(By.ID, "swap-submit").click()
    wait.until(ec.text_to_be_present_in_element((By.ID, "model-version"), "console-v2"))
    wait.until(ec.text_to_be_present_in_element((By.ID, "swap-result"), "→ console-v2"))
    versions = console.find_element(By.ID, "versions").text
    assert "console-v2" in versions and len(versions.splitlines()) >= 2
    errors = [
        e
        for e in console.get_log("browser")
        # (the wrong token's 401 at login is the browser's only expected complaint)
        if e["level"] == "SEVERE" and not any(w in e["message"] for w in ("favicon", "login"))
    ]
    assert not errors, errors
