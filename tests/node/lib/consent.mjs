// The person in front of the browser, for test clients: follows an authorization URL to
// ToastMachine's consent page and approves it by creating a new agent. Returns the redirect the
// authorization server answers with (the client's callback URL carrying code, state and iss).
const HIDDEN = /<input type="hidden" name="(\w+)" value="([^"]*)"/g;

function cookies(response) {
  return response.headers.getSetCookie().map((c) => c.split(';')[0]).join('; ');
}

export async function approve(authorizationUrl, agentName) {
  const authorize = await fetch(authorizationUrl, { redirect: 'manual' });
  if (authorize.status !== 302) {
    throw new Error(`authorize answered ${authorize.status}: ${await authorize.text()}`);
  }
  const consentUrl = new URL(authorize.headers.get('location'), authorizationUrl);
  const page = await fetch(consentUrl, { redirect: 'manual' });
  if (page.status !== 200) throw new Error(`consent page answered ${page.status}`);
  const html = await page.text();
  const form = new URLSearchParams();
  for (const [, name, value] of html.matchAll(HIDDEN)) form.set(name, value);
  form.set('mode', 'create');
  form.set('name', agentName);
  form.set('action', 'approve');
  const decided = await fetch(new URL('/consent', consentUrl), {
    method: 'POST',
    redirect: 'manual',
    headers: { 'content-type': 'application/x-www-form-urlencoded', cookie: cookies(page) },
    body: form,
  });
  if (decided.status !== 303) {
    throw new Error(`consent answered ${decided.status}: ${await decided.text()}`);
  }
  return new URL(decided.headers.get('location'));
}
