// Module resolution hook: hand the conformance CLI our fs (with globSync) on Node < 22.
const shim = new URL('./fs-glob.mjs', import.meta.url).href;

export async function resolve(specifier, context, next) {
  const fromConformance = context.parentURL?.includes('/node_modules/@modelcontextprotocol/conformance/');
  if (fromConformance && (specifier === 'fs' || specifier === 'node:fs')) {
    return { url: shim, shortCircuit: true };
  }
  return next(specifier, context);
}
