// An in-memory OAuth client provider, the shape both SDKs (v1 `OAuthClientProvider` and v2's) call:
// the SDK discovers the metadata, registers dynamically and builds the PKCE authorization URL; this
// provider plays the user agent by approving the consent page (lib/consent.mjs) and keeps the callback
// URL for the script to hand back to the transport's finishAuth.
import { randomUUID } from 'node:crypto';

import { approve } from './consent.mjs';

export const REDIRECT_URL = 'http://127.0.0.1:53682/callback';

export class ConsentingProvider {
  constructor({ agentName, clientName, scope }) {
    this.agentName = agentName;
    this.clientName = clientName;
    this.scope = scope;
    this.callback = undefined;
    this._client = undefined;
    this._tokens = undefined;
    this._verifier = undefined;
    this._state = undefined;
    this._discovery = undefined;
  }

  get redirectUrl() {
    return REDIRECT_URL;
  }

  get clientMetadata() {
    return {
      client_name: this.clientName,
      redirect_uris: [REDIRECT_URL],
      grant_types: ['authorization_code', 'refresh_token'],
      response_types: ['code'],
      token_endpoint_auth_method: 'none',
      scope: this.scope,
    };
  }

  state() {
    this._state = randomUUID();
    return this._state;
  }

  clientInformation() {
    return this._client;
  }

  saveClientInformation(info) {
    this._client = info;
  }

  tokens() {
    return this._tokens;
  }

  saveTokens(tokens) {
    this._tokens = tokens;
  }

  saveCodeVerifier(verifier) {
    this._verifier = verifier;
  }

  codeVerifier() {
    if (!this._verifier) throw new Error('no PKCE verifier saved');
    return this._verifier;
  }

  // v2 checks on the callback leg that the code goes back to the authorization server it came from.
  saveDiscoveryState(state) {
    this._discovery = state;
  }

  discoveryState() {
    return this._discovery;
  }

  async redirectToAuthorization(url) {
    this.callback = await approve(url, this.agentName);
  }

  /** The callback's query, after checking that it answers our request (the SDK leaves `state` to us). */
  callbackParams() {
    if (!this.callback) throw new Error('the authorization flow did not reach the callback');
    const params = this.callback.searchParams;
    if (params.get('state') !== this._state) throw new Error('state mismatch in the callback');
    if (!params.get('code')) throw new Error(`no code in the callback: ${params.get('error')}`);
    return params;
  }
}

/** Parse `<mcp url> <agent name>` from argv or exit with usage. */
export function args(script) {
  const [url, agentName] = process.argv.slice(2);
  if (!url || !agentName) {
    console.error(`usage: node ${script} <mcp url> <agent name>`);
    process.exit(2);
  }
  return { url: new URL(url), agentName };
}
