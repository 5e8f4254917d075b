"""The built book in a real browser (issue 54): Debian's Chromium, headless, with no network,
loads every page of `_build/html` in a 1,400-px window and reports each box whose content is
cut off sideways (scrollWidth > clientWidth): code, outputs and prose must be 0; every formula
is typeset by the bundled MathJax (nothing fetched from a CDN); and a recorded result's staleness
label is shown folded (_static/stale-labels.js), never as a raw output line.

Run by `make book-check` after `make book` (CI: .ci/run), about a minute; `make browser` installs
chromium and chromium-driver from Debian where they are missing. Skipped when the book is not
built or Chromium is absent (so `pytest tests` elsewhere does not fail on it)."""

import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.book

ROOT = Path(__file__).resolve().parent.parent
HTML = ROOT / "_build" / "html"
WIDTH_PX, HEIGHT_PX = 1400, 1000
# Sphinx's generated pages (index of terms, search) hold no course content
SKIP = {"genindex.html", "search.html", "py-modindex.html"}

# Each box's kind, its selector and how much of its text a report shows. `scrollWidth >
# clientWidth` is true for a box that scrolls sideways (overflow: auto) and for one whose content
# spills past its edge (overflow: visible).
OVERFLOWS_JS = """
const kinds = {
  code: 'div.cell_input pre, article div.highlight pre',
  output: 'div.cell_output pre, div.cell_output .output',
  prose: 'article p, article li, article dd, article h1, article h2, article h3',
  table: 'article table',
};
const found = [];
const seen = new Set();
for (const [kind, selector] of Object.entries(kinds)) {
  for (const box of document.querySelectorAll(selector)) {
    if (seen.has(box)) continue;
    seen.add(box);
    if (kind === 'code' && box.closest('div.cell_output')) continue;
    if (box.offsetParent === null) continue;  // hidden (a folded cell)
    if (box.scrollWidth > box.clientWidth + 1) {
      found.push({kind: kind, excess_px: box.scrollWidth - box.clientWidth,
                  text: box.innerText.split('\\n').find(l => l.trim()) || ''});
    }
  }
}
return found;
"""

# A recorded result's staleness label still shown as a raw output line (_static/stale-labels.js
# folds it into a short note)
RAW_LABELS_JS = """
return [...document.querySelectorAll('div.cell_output pre')].filter(
  pre => pre.offsetParent !== null && pre.innerText.includes('recorded with an earlier version: ')
).length;
"""

# Wait for MathJax to typeset; return [formulas, typeset, the MathJax script's source]
MATH_JS = """
const done = arguments[arguments.length - 1];
const math = document.querySelectorAll('span.math, div.math');
const script = document.querySelector('script[src*="mathjax"], script[src*="tex-"]');
const source = script ? script.getAttribute('src') : null;
const count = () => done([math.length, document.querySelectorAll('mjx-container').length, source]);
if (!math.length) { count(); return; }
const wait = (tries) => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    MathJax.startup.promise.then(count);
  } else if (tries > 0) { setTimeout(() => wait(tries - 1), 100); } else { count(); }
};
wait(100);
"""


def pages() -> list[Path]:
    return sorted(
        p
        for p in HTML.rglob("*.html")
        if "_static" not in p.parts and "_sources" not in p.parts and p.name not in SKIP
    )


@pytest.fixture(scope="module")
def browser():
    if not (HTML / "index.html").exists():
        pytest.skip("the book is not built (make book)")
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip("no chromium/chromedriver (make browser installs Debian's)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root
        "--disable-dev-shm-usage",
        f"--window-size={WIDTH_PX},{HEIGHT_PX}",
        # no network: every request through a proxy that does not exist
        "--proxy-server=http://127.0.0.1:9",
        "--proxy-bypass-list=<-loopback>",
    ):
        options.add_argument(argument)
    session = webdriver.Chrome(service=Service(driver), options=options)
    session.set_script_timeout(30)
    yield session
    session.quit()


def test_no_box_is_cut_off_sideways_and_math_renders_offline(browser):
    assert browser.execute_script("return window.innerWidth") == WIDTH_PX
    overflows, untypeset, checked, formulas = [], [], 0, 0
    for page in pages():
        browser.get(page.as_uri())
        name = page.relative_to(HTML).as_posix()
        for box in browser.execute_script(OVERFLOWS_JS):
            overflows.append(f"{name}: {box['kind']} +{box['excess_px']} px: {box['text'][:90]}")
        raw_labels = browser.execute_script(RAW_LABELS_JS)
        if raw_labels:
            overflows.append(f"{name}: {raw_labels} staleness labels shown raw, not folded")
        math, typeset, source = browser.execute_async_script(MATH_JS)
        if math:
            formulas += math
            if typeset < math or not (source or "").startswith(("_static/", "../_static/")):
                untypeset.append(f"{name}: {typeset} of {math} formulas typeset, MathJax {source}")
        checked += 1
    assert checked >= 30, f"only {checked} pages under {HTML}"
    assert formulas > 0, "no formula in the whole book: the MathJax check checked nothing"
    report = "\n".join(overflows)
    assert not overflows, f"{len(overflows)} boxes cut off at {WIDTH_PX} px:\n{report}"
    assert not untypeset, "\n".join(untypeset)
