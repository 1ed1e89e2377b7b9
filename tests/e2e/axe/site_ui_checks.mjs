// Checks of the site's approval page (`cardiofl site ui`) in a real Chromium, printed as one JSON object on
// stdout: axe-core's violations before and after an approval and after a decline, and a keyboard-only approve,
// revoke, then decline (Tab to the button, Enter; for the decline, Tab to the reason's field and type it first),
// with what the page's live region announced. With a third argument, a screenshot there.
//
// usage: node site_ui_checks.mjs CHROMIUM PAGE_URL [SCREENSHOT.png]
//   PAGE_URL carries the page's token in its hash (http://127.0.0.1:PORT/#token=...) and offers one study.
import puppeteer from "puppeteer-core";
import { axeViolations } from "./axe_common.mjs";

const [chromium, url, screenshot] = process.argv.slice(2);
if (!chromium || !url) {
  console.error("usage: node site_ui_checks.mjs CHROMIUM PAGE_URL [SCREENSHOT.png]");
  process.exit(2);
}

// Presses Tab until the focused element is the button of `action`; how many presses (null: never reached).
async function tabTo(page, action, most = 60) {
  for (let presses = 1; presses <= most; presses++) {
    await page.keyboard.press("Tab");
    if (await page.evaluate((a) => document.activeElement?.dataset?.action === a, action)) return presses;
  }
  return null;
}

async function announced(page, prefix) {
  await page.waitForFunction(
    (p) => document.getElementById("result").textContent.startsWith(p),
    { timeout: 15000, polling: 50 },
    prefix,
  );
  return page.evaluate(() => ({
    result: document.getElementById("result").textContent,
    state: document.querySelector("[data-field=state]")?.textContent ?? null,
    focused: document.activeElement?.id ?? null,
    reason: document.querySelector("[data-field=decline-reason]")?.textContent ?? null,
    declines: [...document.querySelectorAll("#declines-table tbody tr")].map((tr) => tr.lastChild.textContent),
  }));
}

const REASON = "Our ethics board has not cleared this cohort";

// With the keyboard only: Tab to the reason's field, type it, Tab to Decline, Enter; what was announced.
async function declineByKeyboard(page, out) {
  out.tabsToReason = await tabTo(page, "decline-reason");
  if (out.tabsToReason === null) return;
  await page.keyboard.type(REASON);
  await page.keyboard.press("Tab");
  out.declineFocused = await page.evaluate(() => document.activeElement?.dataset?.action ?? null);
  await page.keyboard.press("Enter");
  out.declined = await announced(page, "declined study");
  out.violationsDeclined = await axeViolations(page);
}

const browser = await puppeteer.launch({
  executablePath: chromium,
  headless: true,
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"],
  defaultViewport: { width: 1100, height: 900 },
});
const out = { errors: [] };
try {
  const page = await browser.newPage();
  page.on("pageerror", (err) => out.errors.push(String(err)));
  await page.goto(url, { waitUntil: "load" });
  await page.waitForSelector("body[data-loaded=true] button[data-action=approve]", { timeout: 15000 });
  out.addressBar = await page.evaluate(() => window.location.href);
  out.violations = await axeViolations(page);
  if (screenshot) await page.screenshot({ path: screenshot, fullPage: true });

  out.tabsToApprove = await tabTo(page, "approve");
  if (out.tabsToApprove !== null) {
    await page.keyboard.press("Enter");
    out.approved = await announced(page, "approved study");
    out.violationsApproved = await axeViolations(page);
    out.tabsToRevoke = await tabTo(page, "revoke");
    if (out.tabsToRevoke !== null) {
      await page.keyboard.press("Enter");
      out.revoked = await announced(page, "revoked the approval");
      await declineByKeyboard(page, out);
    }
  }
} catch (err) {
  out.errors.push(String(err));
} finally {
  await browser.close();
}
console.log(JSON.stringify(out));
