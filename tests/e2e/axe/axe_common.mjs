// axe-core run in a page, shared by the checks of the dashboard, its panels and the site's approval page.
import { createRequire } from "node:module";
import { readFile } from "node:fs/promises";

const axeSource = await readFile(createRequire(import.meta.url).resolve("axe-core/axe.min.js"), "utf8");

// axe-core's violations on `page` now: each rule's id, impact and help, with the nodes that fail it.
export async function axeViolations(page) {
  await page.evaluate(axeSource);
  return page.evaluate(async () => {
    const result = await window.axe.run(document, { resultTypes: ["violations"] });
    return result.violations.map((v) => ({
      id: v.id,
      impact: v.impact,
      help: v.help,
      nodes: v.nodes.map((n) => ({ target: n.target.join(" "), summary: n.failureSummary })),
    }));
  });
}
