// Node 20 lacks fs.globSync (added in Node 22), which the conformance CLI imports by name.
// This module is everything `node:fs` exports plus a globSync that supports the one pattern shape the
// CLI uses (`**/<file name>` under a cwd); any other pattern fails loudly instead of matching wrongly.
import fs from 'node:fs';
import path from 'node:path';

export * from 'node:fs';
export default fs;

export function globSync(pattern, options = {}) {
  const match = /^\*\*\/([^*?[\]{}/]+)$/.exec(pattern);
  if (!match) throw new Error(`globSync shim: unsupported pattern ${pattern}`);
  const root = options.cwd ?? process.cwd();
  const found = [];
  const walk = (relative) => {
    for (const entry of fs.readdirSync(path.join(root, relative), { withFileTypes: true })) {
      const child = relative ? path.join(relative, entry.name) : entry.name;
      if (entry.isDirectory()) walk(child);
      else if (entry.name === match[1]) found.push(child);
    }
  };
  walk('');
  return found;
}
