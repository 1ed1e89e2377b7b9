// Checks of the dashboard in a real Chromium, printed as one JSON object on stdout: axe-core's
// violations (the dashboard with data, also in a narrow window, and the token form), whether a refresh
// keeps the row elements, whether polling pauses while the tab is hidden, and whether a study row is
// reachable with Tab and selectable with Enter and Space.
//
// usage: node dashboard_checks.mjs CHROMIUM DASHBOARD_URL
//   DASHBOARD_URL carries the viewer token in its hash (/dashboard?study=1#token=...) and lists at least
//   two studies, the selected one with rounds.
import puppeteer from "puppeteer-core";
import { axeViolations } from "./axe_common.mjs";

const [chromium, url] = process.argv.slice(2);
if (!chromium || !url) {
  console.error("usage: node dashboard_checks.mjs CHROMIUM DASHBOARD_URL");
  process.exit(2);
}
const sleep = (ms) => new Promise((done) => setTimeout(done, ms));

// Resolves once the dashboard finished a refresh after the one it shows now.
async function nextRefresh(page, timeout = 8000) {
  const before = await page.$eval("#last-updated", (t) => t.getAttribute("datetime"));
  await page.waitForFunction(
    (b) => document.getElementById("last-updated").getAttribute("datetime") !== b,
    { timeout, polling: 50 },
    before,
  );
}

// Every fetch the page starts, with its time, and a switch for the tab's visibility.
function instrument() {
  const realFetch = window.fetch.bind(window);
  const checks = { fetches: [], inFlight: 0, lastActivity: 0 };
  window.__checks = checks;
  window.fetch = (...args) => {
    checks.fetches.push(performance.now());
    checks.inFlight++;
    checks.lastActivity = performance.now();
    return realFetch(...args).finally(() => {
      checks.inFlight--;
      checks.lastActivity = performance.now();
    });
  };
  // Returns when the event was dispatched.
  window.__setHidden = (hidden) => {
    Object.defineProperty(document, "hidden", { configurable: true, get: () => hidden });
    Object.defineProperty(document, "visibilityState", { configurable: true, get: () => (hidden ? "hidden" : "visible") });
    const at = performance.now();
    document.dispatchEvent(new Event("visibilitychange"));
    return at;
  };
}

const browser = await puppeteer.launch({
  executablePath: chromium,
  headless: true,
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"],
  defaultViewport: { width: 1400, height: 1100 },
});
const out = {};
try {
  const page = await browser.newPage();
  const errors = [];
  page.on("pageerror", (err) => errors.push(String(err)));
  await page.evaluateOnNewDocument(instrument);
  await page.goto(url, { waitUntil: "load" });
  await page.waitForSelector("#rounds-table tbody tr[data-round]", { timeout: 15000 });
  await page.waitForSelector("#sites-table tbody tr[data-site]", { timeout: 15000 });

  out.violations = await axeViolations(page);

  // A refresh updates rows in place: the very same elements are there afterwards.
  const tables = ["#studies-table", "#sites-table", "#rounds-table", "#weights-table"];
  const marked = await page.evaluate((ts) => {
    const n = {};
    for (const t of ts) {
      const rows = [...document.querySelectorAll(t + " tbody tr")];
      rows.forEach((tr) => (tr.__mark = true));
      n[t] = rows.length;
    }
    return n;
  }, tables);
  await nextRefresh(page);
  const kept = await page.evaluate((ts) => {
    const n = {};
    for (const t of ts) n[t] = [...document.querySelectorAll(t + " tbody tr")].filter((tr) => tr.__mark).length;
    return n;
  }, tables);
  out.refresh = { marked, kept };

  // Hidden tab: no fetch for longer than the refresh interval; visible again: a fetch at once.
  // (a refresh under way when the tab is hidden may finish: wait until no request for 300 ms)
  await page.evaluate(() => window.__setHidden(true));
  await page.waitForFunction(
    () => window.__checks.inFlight === 0 && performance.now() - window.__checks.lastActivity > 300,
    { polling: 20, timeout: 10000 },
  );
  const hiddenFrom = await page.evaluate(() => window.__checks.fetches.length);
  await sleep(3500);
  const hiddenTo = await page.evaluate(() => window.__checks.fetches.length);
  const shownAt = await page.evaluate(() => window.__setHidden(false));
  await sleep(500);
  const firstAfter = await page.evaluate((t) => window.__checks.fetches.find((f) => f >= t), shownAt);
  out.hidden = {
    fetchesWhileHidden: hiddenTo - hiddenFrom,
    msToFirstFetchWhenVisible: firstAfter === undefined ? null : Math.round(firstAfter - shownAt),
  };

  // Keyboard: Tab reaches a study row; Enter selects it; focus and selection survive the next refresh;
  // the arrow keys move between rows and Space selects too.
  await page.evaluate(() => document.activeElement && document.activeElement.blur());
  let tabs = 0;
  let focused = null;
  while (tabs < 30 && !focused) {
    await page.keyboard.press("Tab");
    tabs++;
    focused = await page.evaluate(() => document.activeElement.closest("tr[data-study]")?.dataset.study ?? null);
  }
  const rowState = () =>
    page.evaluate(() => {
      const a = document.activeElement;
      const selected = [...document.querySelectorAll('#studies-table tr[aria-selected="true"]')];
      return {
        focused: a.dataset.study ?? null,
        focusedIsMarked: Boolean(a.__kbd),
        focusVisible: a.matches(":focus-visible"),
        outline: getComputedStyle(a).outlineStyle,
        selected: selected.map((tr) => tr.dataset.study),
        search: location.search,
        roundsOf: document.getElementById("study-name").textContent,
      };
    });
  const keyboard = { tabs, focused };
  if (focused) {
    await page.evaluate(() => (document.activeElement.__kbd = true));
    await page.keyboard.press("Enter");
    await page.waitForFunction(
      (id) => document.getElementById("study-name").textContent.includes("#" + id),
      { timeout: 5000, polling: 50 },
      focused,
    );
    keyboard.afterEnter = await rowState();
    await nextRefresh(page);
    keyboard.afterRefresh = await rowState();
    await page.keyboard.press("ArrowDown");
    const below = await page.evaluate(() => document.activeElement.dataset.study ?? null);
    const scrollBefore = await page.evaluate(() => window.scrollY);
    await page.keyboard.press(" ");
    if (below) {
      await page.waitForFunction(
        (id) => document.getElementById("study-name").textContent.includes("#" + id),
        { timeout: 5000, polling: 50 },
        below,
      );
    }
    keyboard.afterSpace = { ...(await rowState()), below, scrolled: (await page.evaluate(() => window.scrollY)) !== scrollBefore };
  }
  out.keyboard = keyboard;

  // A narrow window: the page itself must not scroll sideways (wide tables scroll in their own box).
  await page.setViewport({ width: 360, height: 800 });
  await page.evaluate(() => new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done))));  // resize handled
  out.narrow = {
    pageWidth: await page.evaluate(() => document.documentElement.scrollWidth),
    violations: await axeViolations(page),
  };

  // The token form, as someone without a token in this tab sees it.
  const login = await browser.newPage();
  login.on("pageerror", (err) => errors.push(String(err)));
  await login.goto(new URL("/dashboard", url).href, { waitUntil: "load" });
  await login.waitForSelector("#token-input", { visible: true, timeout: 10000 });
  out.loginViolations = await axeViolations(login);
  out.pageErrors = errors;
} finally {
  await browser.close();
}
process.stdout.write(JSON.stringify(out, null, 1) + "\n");
