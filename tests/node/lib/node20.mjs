// Preloaded with `node --import ./lib/node20.mjs`: registers the fs hook only where it is needed.
import { register } from 'node:module';

if (Number(process.versions.node.split('.')[0]) < 22) {
  register('./fs-hooks.mjs', import.meta.url);
}
