"""The explorer page in a real headless Chromium (Debian's chromium + chromium-driver, through Selenium):
no console errors, a prompt streams tokens, a clicked token shows one row per iteration whose top-1 is
Model.score_logit_lens's, and the prompt's heatmap has L x T cells. On CI a missing browser fails."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tinyloop
from shared_data import require_module, unavailable

require_module("selenium")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
if CHROMIUM is None or DRIVER is None:
    unavailable("chromium and chromedriver are not installed (apt-get install chromium chromium-driver)")

LOOPS = 5
MAX_TOKENS = 12
SCREENSHOT = os.environ.get("TINYLOOP_EXPLORER_SCREENSHOT")  # where to save the page (docs/explorer.png)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1280,1100"):  # fmt: skip
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(str(DRIVER)))
    try:
        yield driver
    finally:
        driver.quit()


def test_the_page_streams_and_shows_the_lens(browser: Any, tiny_model: tinyloop.Model, base_url: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(base_url + "/")
    wait = WebDriverWait(browser, 60)
    wait.until(lambda d: d.find_element(By.ID, "model-name").text == "model: tiny")
    prompt = "The loop é"
    box = browser.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(prompt)
    for field, value in (("loops", LOOPS), ("max-tokens", MAX_TOKENS), ("temperature", 0)):
        element = browser.find_element(By.ID, field)
        element.clear()
        element.send_keys(str(value))
    browser.find_element(By.ID, "run").click()
    wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-done") == "1")

    ids = tiny_model.encode(prompt)
    generated = browser.find_elements(By.CSS_SELECTOR, "#output .token.gen")
    expected = tiny_model.generate(ids, MAX_TOKENS, loops=LOOPS, temperature=0)
    assert len(generated) == MAX_TOKENS == expected.size
    assert browser.find_elements(By.CSS_SELECTOR, "#output .token.prompt")[-1].text == "\\xA9"  # é's 2nd byte
    cells = browser.find_elements(By.CSS_SELECTOR, "#heatmap rect.cell")
    assert len(cells) == LOOPS * ids.size
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(browser).move_to_element(cells[ids.size + 1]).perform()  # iteration 2, position 1 ("h")
    hover = browser.find_element(By.ID, "hover").text
    assert "iteration 2, position 1" in hover and 'input   "h"' in hover

    sequence = np.concatenate([ids, expected])
    lens = tiny_model.score_logit_lens(sequence, loops=LOOPS)
    for index in (ids.size + 3, 2):  # a generated token, then a prompt token
        browser.find_element(By.CSS_SELECTOR, f'#output .token[data-index="{index}"]').click()
        rows = browser.find_elements(By.CSS_SELECTOR, "#lens-table tr.lens-row")
        assert len(rows) == LOOPS
        top1 = [int(row.get_attribute("data-top1")) for row in rows]
        assert top1 == lens[:, index - 1].argmax(-1).tolist()  # token p was predicted at position p - 1
    assert browser.find_elements(By.CSS_SELECTOR, "#curve polyline")

    if SCREENSHOT:  # the docs' picture: an exit criterion, so the shading shows each token's depth
        from selenium.webdriver.support.ui import Select

        Select(browser.find_element(By.ID, "exit-criterion")).select_by_value("kl")
        browser.find_element(By.ID, "run").click()
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-done") == "1")
        browser.find_element(By.CSS_SELECTOR, f'#output .token[data-index="{ids.size + 4}"]').click()
        Path(SCREENSHOT).write_bytes(browser.get_screenshot_as_png())
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == [], errors
