// Starts s3rver (an S3-compatible server) on 127.0.0.1 at a port the kernel picks, for s3_test.
//   node s3rver_run.js DIRECTORY REQUEST_LOG BUCKET...
// Creates the buckets, prints "PORT <n>" on stdout once listening, and appends "METHOD URL" to
// REQUEST_LOG for every request it receives, so tests count GETs on the server's side.
// s3rver checks the access key id (S3RVER) but not V4 signatures; see docs/image-data.md. Run it
// with node --openssl-legacy-provider: its ListObjectsV2 continuation tokens are DES-encrypted.
'use strict';
const fs = require('fs');
const path = require('path');
const S3rver = require(path.join(__dirname, 'node_modules', 's3rver'));

const [directory, requestLog, ...buckets] = process.argv.slice(2);
const server = new S3rver({
  address: '127.0.0.1',
  port: 0,
  directory,
  silent: true,
  configureBuckets: buckets.map((name) => ({ name })),
});
server.run().then(
  (address) => {
    server.httpServer.on('request', (req) => fs.appendFileSync(requestLog, `${req.method} ${req.url}\n`));
    process.stdout.write(`PORT ${address.port}\n`);
  },
  (err) => {
    process.stderr.write(`s3rver_run: ${err.stack}\n`);
    process.exit(1);
  },
);
