// Checks of the dashboard's site-job panels (survey, external validation, evaluation) in a real Chromium, printed
// as one JSON object on stdout: axe-core's violations and the page's errors for each URL, and the survey table's
// rows after the "test" group is picked, then after a refresh with it still picked.
//
// usage: node panels_checks.mjs CHROMIUM SURVEY_URL [OTHER_URL...]
//   each URL carries the viewer token in its hash (/dashboard?study=2#token=...); the first shows a survey study.
import puppeteer from "puppeteer-core";
import { axeViolations } from "./axe_common.mjs";

const [chromium, ...urls] = process.argv.slice(2);
if (!chromium || !urls.length) {
  console.error("usage: node panels_checks.mjs CHROMIUM SURVEY_URL [OTHER_URL...]");
  process.exit(2);
}

const surveyRows = (page) =>
  page.$$eval("#survey-table tbody tr", (rows) => rows.map((tr) => [...tr.cells].map((c) => c.textContent)));

const browser = await puppeteer.launch({
  executablePath: chromium,
  headless: true,
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"],
  defaultViewport: { width: 1400, height: 1100 },
});
const out = { pages: [] };
try {
  for (const [index, url] of urls.entries()) {
    const page = await browser.newPage();
    const errors = [];
    page.on("pageerror", (err) => errors.push(String(err)));
    await page.goto(url, { waitUntil: "load" });
    await page.waitForSelector("body[data-ready='1']", { timeout: 15000 });
    out.pages.push({ url, violations: await axeViolations(page), pageErrors: errors });
    if (index === 0) {
      await page.select("#survey-group", "test");
      out.surveyTest = await surveyRows(page);
      out.surveyLegend = await page.$eval("#survey-legend", (ul) => ul.textContent);
      const before = await page.$eval("#last-updated", (t) => t.getAttribute("datetime"));
      await page.waitForFunction((b) => document.getElementById("last-updated").getAttribute("datetime") !== b, { timeout: 8000 }, before);
      out.surveyTestAfterRefresh = await surveyRows(page);
    }
    await page.close();
  }
} finally {
  await browser.close();
}
process.stdout.write(JSON.stringify(out));
