// Starts s3rver (an S3-compatible server) on 127.0.0.1 at a port the kernel picks, for s3_test.
//   node --openssl-legacy-provider s3rver_run.js [--fail-first=K] DIRECTORY REQUEST_LOG BUCKET...
//   node s3rver_run.js --self-test    checks the verifier below on AWS's published example
// Creates the buckets, prints "PORT <n>" on stdout once listening, and appends "METHOD URL" to
// REQUEST_LOG for every request it receives, so tests count GETs on the server's side.
// --fail-first=K: the first K GETs of each object are answered 503 SlowDown (logged "METHOD URL
// 503") before s3rver sees them, as an overloaded S3 does; per object, so the count is the same
// whatever order concurrent requests arrive in.
//
// s3rver 3.7.1 checks the access key id but skips AWS Signature V4 verification, so this wrapper
// verifies every signed request first, the way S3 does (AWS's SigV4 specification: canonical request
// from the decoded and re-encoded path and query, the signed headers, x-amz-content-sha256;
// credential scope us-east-1/s3), and answers 403 SignatureDoesNotMatch where it differs. Every
// x-amz-* header must be signed (as S3 requires). Not checked: that the body's SHA-256 equals
// x-amz-content-sha256 (s3rver reads the body itself).
// --openssl-legacy-provider: s3rver encrypts ListObjectsV2 continuation tokens with DES, which
// OpenSSL 3 keeps in its legacy provider.
'use strict';
const crypto = require('crypto');
const fs = require('fs');
const http = require('http');
const path = require('path');
const S3rver = require(path.join(__dirname, 'node_modules', 's3rver'));

const SECRETS = { S3RVER: 'S3RVER' }; // s3rver's built-in account
const REGION = 'us-east-1';

const sha256 = (data) => crypto.createHash('sha256').update(data).digest('hex');
const hmac = (key, data) => crypto.createHmac('sha256', key).update(data).digest();
// RFC 3986: everything but A-Z a-z 0-9 - _ . ~ is %XX (upper case); '/' kept in paths.
const uriEncode = (s, keepSlash) =>
  Array.from(Buffer.from(s, 'utf8'))
    .map((b) => {
      const c = String.fromCharCode(b);
      if (/[A-Za-z0-9\-_.~]/.test(c) || (keepSlash && c === '/')) return c;
      return '%' + b.toString(16).toUpperCase().padStart(2, '0');
    })
    .join('');

// Returns null when the request is unsigned, for an unknown key (s3rver answers those), or the
// signature matches; else [status, code, message].
function checkSignature(req, secrets = SECRETS) {
  const auth = req.headers['authorization'];
  if (!auth || !auth.startsWith('AWS4-HMAC-SHA256 ')) return null;
  const parts = Object.fromEntries(
    auth
      .slice('AWS4-HMAC-SHA256 '.length)
      .split(',')
      .map((p) => p.trim().split(/=(.*)/s).slice(0, 2)),
  );
  const [accessKey, date, region, service, terminator] = (parts.Credential || '').split('/');
  if (!(accessKey in secrets)) return null;
  if (region !== REGION || service !== 's3' || terminator !== 'aws4_request') {
    return [400, 'AuthorizationHeaderMalformed', `credential scope ${date}/${region}/${service}; expecting region ${REGION}, service s3`];
  }
  const signed = (parts.SignedHeaders || '').split(';');
  for (const name of Object.keys(req.headers)) {
    if (name.startsWith('x-amz-') && !signed.includes(name)) {
      return [403, 'AccessDenied', `header ${name} is not signed`];
    }
  }
  if (!signed.includes('host')) return [403, 'AccessDenied', 'host is not signed'];
  const payloadHash = req.headers['x-amz-content-sha256'];
  if (!payloadHash) return [400, 'InvalidRequest', 'missing x-amz-content-sha256'];

  const [rawPath, rawQuery = ''] = req.url.split(/\?(.*)/s);
  const canonicalUri = uriEncode(decodeURIComponent(rawPath), true);
  const canonicalQuery = rawQuery
    .split('&')
    .filter((p) => p.length > 0)
    .map((p) => {
      const [k, v = ''] = p.split(/=(.*)/s);
      return [uriEncode(decodeURIComponent(k), false), uriEncode(decodeURIComponent(v), false)];
    })
    .sort((a, b) => (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : a[1] < b[1] ? -1 : a[1] > b[1] ? 1 : 0))
    .map(([k, v]) => `${k}=${v}`)
    .join('&');
  const canonicalHeaders = signed
    .map((h) => `${h}:${String(req.headers[h] || '').trim().replace(/\s+/g, ' ')}\n`)
    .join('');
  const canonicalRequest = [req.method, canonicalUri, canonicalQuery, canonicalHeaders, signed.join(';'), payloadHash].join('\n');
  const amzDate = req.headers['x-amz-date'] || '';
  const scope = `${date}/${region}/${service}/aws4_request`;
  const stringToSign = ['AWS4-HMAC-SHA256', amzDate, scope, sha256(canonicalRequest)].join('\n');
  let key = hmac('AWS4' + secrets[accessKey], date);
  for (const part of [region, service, 'aws4_request']) key = hmac(key, part);
  const expected = crypto.createHmac('sha256', key).update(stringToSign).digest('hex');
  if (expected !== parts.Signature) {
    return [403, 'SignatureDoesNotMatch', 'The request signature we calculated does not match the signature you provided. Check your key and signing method.'];
  }
  return null;
}

async function main() {
  let args = process.argv.slice(2);
  let failFirst = 0;
  if (args.length > 0 && args[0].startsWith('--fail-first=')) {
    failFirst = parseInt(args[0].slice('--fail-first='.length), 10);
    args = args.slice(1);
  }
  const getsOf = new Map(); // object URL -> GETs received
  const [directory, requestLog, ...buckets] = args;
  const s3rver = new S3rver({ directory, silent: true, configureBuckets: buckets.map((name) => ({ name })) });
  await s3rver.configureBuckets();
  const app = s3rver.callback();
  const server = http.createServer((req, res) => {
    const objectGet = req.method === 'GET' && !req.url.includes('list-type=');
    const seen = objectGet ? (getsOf.get(req.url) || 0) + 1 : 0;
    if (objectGet) getsOf.set(req.url, seen);
    if (objectGet && seen <= failFirst) {
      fs.appendFileSync(requestLog, `${req.method} ${req.url} 503\n`);
      const body = '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>';
      res.writeHead(503, { 'Content-Type': 'application/xml', 'Content-Length': Buffer.byteLength(body) });
      res.end(body);
      return;
    }
    fs.appendFileSync(requestLog, `${req.method} ${req.url}\n`);
    const failure = checkSignature(req);
    if (failure === null) return app(req, res);
    const [status, code, message] = failure;
    const body = `<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>${code}</Code><Message>${message}</Message></Error>`;
    res.writeHead(status, { 'Content-Type': 'application/xml', 'Content-Length': Buffer.byteLength(body) });
    res.end(body);
  });
  server.listen(0, '127.0.0.1', () => process.stdout.write(`PORT ${server.address().port}\n`));
}

// AWS's example "GET Object" request (Amazon S3 API reference, "Signature Calculations for the
// Authorization Header: Transferring Payload in a Single Chunk"), with its published signature.
function selfTest() {
  const secrets = { AKIAIOSFODNN7EXAMPLE: 'wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY' };
  const req = {
    method: 'GET',
    url: '/test.txt',
    headers: {
      host: 'examplebucket.s3.amazonaws.com',
      range: 'bytes=0-9',
      'x-amz-content-sha256': 'e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855',
      'x-amz-date': '20130524T000000Z',
      authorization:
        'AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,' +
        'SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,' +
        'Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41',
    },
  };
  const good = checkSignature(req, secrets);
  req.headers.range = 'bytes=0-10';
  const tampered = checkSignature(req, secrets);
  if (good !== null || tampered === null || tampered[1] !== 'SignatureDoesNotMatch') {
    process.stderr.write(`self-test FAILED: example ${JSON.stringify(good)}, tampered ${JSON.stringify(tampered)}\n`);
    process.exit(1);
  }
  process.stdout.write('self-test passed: AWS example accepted, tampered copy refused\n');
}

if (process.argv[2] === '--self-test') {
  selfTest();
  process.exit(0);
}
main().catch((err) => {
  process.stderr.write(`s3rver_run: ${err.stack}\n`);
  process.exit(1);
});
