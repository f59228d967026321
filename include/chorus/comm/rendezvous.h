// Turning an init URL into a store, a rank and a world size, as torch.distributed does.
//
//   env://                    MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE (and CHORUS_JOB_TOKEN)
//   tcp://HOST:PORT?rank=R&world_size=W[&token=T]
//   file:///PATH?rank=R&world_size=W
//
// Explicit rank / world_size arguments (>= 0) override the URL and the environment. With env:// and
// tcp://, rank 0 hosts the TcpStore server unless CHORUS_STORE_EXTERNAL=1 says a launcher already
// hosts it. The job token comes from the URL's token=, else CHORUS_JOB_TOKEN, else "".
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "chorus/comm/store.h"

namespace chorus {

struct RendezvousOptions {
  std::chrono::milliseconds timeout = Store::kDefaultTimeout;
};

struct Rendezvous {
  std::shared_ptr<Store> store;
  int rank = -1;
  int world_size = -1;
  std::string token;
  // The address of this host as seen on the store connection (for publishing listen addresses);
  // "" for stores without a network connection.
  std::string local_address;
};

// Throws UsageError for a malformed URL or missing variables (naming them), TimeoutError when the
// store cannot be reached in time.
Rendezvous rendezvous(const std::string& url, int rank = -1, int world_size = -1,
                      RendezvousOptions options = {});

}  // namespace chorus
