// The `chorus` command: `chorus run ...` (the launcher), `chorus bench ...`, `chorus report ...` and
// `chorus data render-fashion-mnist ...`.
//
// Exit codes: 0 on success and for --help/--version, 2 for a usage error (bad option or value),
// else what the subcommand returns (chorus run: 1 when the job failed, 128+N when stopped by
// signal N).
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "bench.h"
#include "chorus/comm/error.h"
#include "chorus/config.h"
#include "chorus/launch/launcher.h"
#include "chorus/report/report.h"
#include "render_fashion_mnist.h"
#include "s3_upload.h"

namespace {

constexpr int kUsageExit = 2;

// `chorus run`'s usage line names the program it starts, which CLI11's default leaves out.
class RunFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App* app, std::string name) const override {
    (void)app;
    return "Usage: " + name + " [OPTIONS] [--] PROGRAM [ARGS...]\n\n"
           "PROGRAM runs once per worker with ARGS and torchrun's environment (RANK, LOCAL_RANK,\n"
           "WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...). Options go before PROGRAM; everything from\n"
           "PROGRAM (or after --) on belongs to it.\n";
  }
};

// Splits `chorus ... run [OPTIONS] -- PROGRAM [ARGS...]` at the "--" (CLI11's prefix command stops
// at PROGRAM by itself but rejects "--"). Walks run's options, skipping the values of those that
// take one, so a "--" after PROGRAM stays PROGRAM's. Returns the arguments for CLI11 and, when a
// "--" ended run's options, the program in *program.
std::vector<std::string> split_program(const std::vector<std::string>& args, const CLI::App& run,
                                       std::vector<std::string>* program) {
  std::vector<std::string> out;
  size_t i = 0;
  for (; i < args.size(); ++i) {  // up to and including the subcommand's name
    out.push_back(args[i]);
    if (args[i] == run.get_name()) break;
  }
  for (++i; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") {
      program->assign(args.begin() + static_cast<std::ptrdiff_t>(i) + 1, args.end());
      return out;
    }
    if (a.size() < 2 || a[0] != '-') break;  // PROGRAM: the rest is CLI11's to hand over
    out.push_back(a);
    if (a.find('=') != std::string::npos) continue;
    const bool long_name = a[1] == '-';
    const std::string name = long_name ? a : a.substr(0, 2);
    if (!long_name && a.size() > 2) continue;  // "-n2"
    const CLI::Option* opt = run.get_option_no_throw(name);
    if (opt != nullptr && opt->get_expected_min() > 0 && i + 1 < args.size()) out.push_back(args[++i]);
  }
  out.insert(out.end(), args.begin() + static_cast<std::ptrdiff_t>(std::min(i, args.size())), args.end());
  return out;
}

// `chorus run`'s options, into *launch, *standalone and *nnodes (N or MIN:MAX, parsed later). As
// torchrun's, each flag's default comes from its PET_ variable (PET_NNODES for --nnodes, ...), which
// is how Kubeflow's trainer and training operator configure the launcher in a pod
// (docs/launch-env.md).
CLI::App* add_run_command(CLI::App& app, chorus::launch::LaunchOptions* launch, bool* standalone, std::string* nnodes) {
  CLI::App* run = app.add_subcommand("run", "start a job's workers on this node (like torchrun)");
  run->prefix_command();  // everything from PROGRAM on belongs to the program
  run->formatter(std::make_shared<RunFormatter>());
  run->add_option("-n,--nproc-per-node,--nproc_per_node", launch->nproc_per_node,
                  "workers on this node: a number or 'auto' (one per core)")
      ->envname("PET_NPROC_PER_NODE")
      ->capture_default_str();
  run->add_option("--nnodes", *nnodes,
                  "number of nodes, or MIN:MAX for an elastic job that re-forms when nodes leave or join "
                  "(docs/elastic.md)")
      ->envname("PET_NNODES")
      ->capture_default_str();
  run->add_option("--node-rank,--node_rank", launch->node_rank,
                  "this node's rank in [0, nnodes) (default also from JOB_COMPLETION_INDEX: a JobSet or indexed Job)")
      ->envname("PET_NODE_RANK")
      ->capture_default_str();
  run->add_option("--rdzv-endpoint,--rdzv_endpoint", launch->rdzv_endpoint,
                  "HOST:PORT of node 0's rendezvous store (default with one node: a local store on a port the "
                  "kernel picks)")
      ->envname("PET_RDZV_ENDPOINT");
  run->add_option("--master-addr,--master_addr", launch->master_addr, "node 0's address (with --master-port)")
      ->envname("PET_MASTER_ADDR");
  run->add_option("--master-port,--master_port", launch->master_port, "node 0's store port, in [1, 65535]")
      ->envname("PET_MASTER_PORT");
  run->add_flag("--standalone", *standalone,
                "one node with a local store on a free port (torchrun's spelling; also the default with one node)");
  run->add_option("--max-restarts,--max_restarts", launch->max_restarts,
                  "restart the whole group this many times after a failure")
      ->envname("PET_MAX_RESTARTS")
      ->capture_default_str();
  run->add_option("--log-dir,--log_dir", launch->log_dir,
                  "write one log per rank here (rank_N.log); rank 0's output also stays on the terminal");
  run->add_flag("--bind-cpu,--bind_cpu", launch->bind_cpu,
                "pin local rank r to the r-th CPU this launcher may run on (when the node's ranks fit its CPUs)");
  run->add_flag("--tee", launch->tee,
                "show every rank's output, each line prefixed [rankN]: (and log it with --log-dir)");
  run->add_option("--ranks-filter,--ranks_filter", launch->ranks_filter,
                  "show only these ranks' output, prefixed [rankN]: (e.g. 0 or 0,2-3); --log-dir keeps every rank's");
  run->add_option("--local-ranks-filter,--local_ranks_filter", launch->local_ranks_filter,
                  "the same by local rank (torchrun's spelling)");
  run->add_option("--grace-period", launch->grace_period_s,
                  "seconds between SIGTERM and SIGKILL when stopping workers, in [0, 3600]")
      ->capture_default_str();
  run->add_option("--rdzv-timeout,--rdzv_timeout", launch->rdzv_timeout_s,
                  "seconds to wait for the store and the other nodes")
      ->capture_default_str();
  run->add_option("--rdzv-last-call,--rdzv_last_call", launch->rdzv_last_call_s,
                  "elastic: seconds a round that has MIN nodes waits for more, in [0, 3600]")
      ->capture_default_str();
  run->add_option("--token", launch->token,
                  "job token (default: CHORUS_JOB_TOKEN, else --token-file, else a fresh one on one node)");
  run->add_option("--token-file,--token_file", launch->token_file,
                  "file holding the job token, readable only by you (or CHORUS_JOB_TOKEN_FILE); needed with --nnodes > 1");
  return run;
}

// `chorus report`'s options, into *report and *gnuplot_timeout_s.
CLI::App* add_report_command(CLI::App& app, chorus::report::ReportOptions* report, double* gnuplot_timeout_s) {
  CLI::App* rep = app.add_subcommand("report", "an HTML page of run directories' metrics (docs/report.md)");
  rep->add_option("RUN_DIR", report->run_dirs, "run directories (config.json, metrics.jsonl; docs/run-records.md)")
      ->required();
  rep->add_option("-o,--out", report->out_dir,
                  "output directory for index.html and figures/ (default: RUN_DIR/report for one run, "
                  "./chorus-report for several)");
  rep->add_option("--gnuplot", report->gnuplot, "the gnuplot program (Debian: gnuplot-nox)")->capture_default_str();
  rep->add_option("--gnuplot-timeout", *gnuplot_timeout_s, "seconds gnuplot may take per figure")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  return rep;
}

// Parses the command line; returns -1 when a subcommand is to run, else main()'s exit status
// (help, version, or a usage error, said on stderr).
int parse(CLI::App& app, const std::vector<std::string>& args, int argc, char** argv) {
  std::vector<std::string> copy = args;
  std::vector<char*> cargs;
  for (auto& a : copy) cargs.push_back(a.data());
  try {
    app.parse(static_cast<int>(cargs.size()), cargs.data());
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    if (app.get_subcommands().empty()) {
      // No subcommand (or an unknown one): say so, then show what exists.
      const bool unknown = argc > 1 && argv[1][0] != '-';
      std::fprintf(stderr, "chorus: %s\n\n%s",
                   unknown ? ("unknown subcommand '" + std::string(argv[1]) + "'").c_str() : e.what(),
                   app.help().c_str());
    } else {
      app.exit(e);
      // A value that came from the environment is otherwise a mystery in that message.
      for (const char* name : {"PET_NPROC_PER_NODE", "PET_NNODES", "PET_NODE_RANK", "PET_RDZV_ENDPOINT",
                               "PET_MASTER_ADDR", "PET_MASTER_PORT", "PET_MAX_RESTARTS"}) {
        if (const char* v = std::getenv(name); v != nullptr) {
          std::fprintf(stderr, "note: %s=%s is set: chorus run takes PET_ variables as its flags' defaults, as torchrun does\n",
                       name, v);
        }
      }
    }
    return kUsageExit;
  }
  return -1;
}

int run_report(chorus::report::ReportOptions& report, double gnuplot_timeout_s) {
  report.gnuplot_timeout = std::chrono::milliseconds(static_cast<int64_t>(gnuplot_timeout_s * 1000));
  try {
    std::printf("%s\n", chorus::report::write_report(report).c_str());
  } catch (const chorus::UsageError&) {
    throw;
  } catch (const chorus::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());  // already says "chorus report: ..."
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"chorus: distributed data-parallel training for libtorch"};
  app.set_version_flag("--version", std::string(CHORUS_VERSION));
  app.require_subcommand(1);
  app.footer("Run `chorus SUBCOMMAND --help` for a subcommand's options.");

  chorus::launch::LaunchOptions launch;
  bool standalone = false;
  std::string nnodes = "1";
  CLI::App* run = add_run_command(app, &launch, &standalone, &nnodes);

  chorus::tools::BenchArgs bench;
  CLI::App* b = app.add_subcommand("bench", "measure a collective on W local ranks");
  chorus::tools::add_bench_options(*b, bench);

  chorus::report::ReportOptions report;
  double gnuplot_timeout_s = 30;
  CLI::App* rep = add_report_command(app, &report, &gnuplot_timeout_s);

  chorus::tools::RenderArgs render;
  CLI::App* data = app.add_subcommand("data", "data set tools");
  data->require_subcommand(1);
  CLI::App* render_cmd = data->add_subcommand(
      "render-fashion-mnist", "write Fashion-MNIST as image files (an ImageFolder tree) and CSV datasets");
  chorus::tools::add_render_options(*render_cmd, render);
  chorus::tools::PairsArgs pairs;
  CLI::App* pairs_cmd = data->add_subcommand(
      "render-fashion-mnist-pairs",
      "write a multi-label CSV dataset: two Fashion-MNIST items side by side per image, the union of their classes");
  chorus::tools::add_pairs_options(*pairs_cmd, pairs);
  chorus::tools::UploadArgs upload;
  CLI::App* upload_cmd = data->add_subcommand(
      "upload", "copy a local tree into s3://BUCKET/PREFIX (AWS_* variables give credentials and endpoint)");
  chorus::tools::add_upload_options(*upload_cmd, upload);

  std::vector<std::string> program;
  const std::vector<std::string> args =
      split_program(std::vector<std::string>(argv, argv + argc), *run, &program);
  if (const int status = parse(app, args, argc, argv); status >= 0) return status;
  try {
    if (run->parsed()) {
      launch.program = program.empty() ? run->remaining() : program;
      chorus::launch::parse_nnodes(nnodes, &launch);
      // A JobSet's (or any indexed Job's) pod knows its index: in a job of several nodes it is the
      // node rank, unless given. (Elastic jobs number their nodes themselves; a one-node job in an
      // indexed Job, a sweep say, keeps node rank 0.)
      if (launch.nnodes > 1 && launch.max_nodes == 0 && run->count("--node-rank") == 0 &&
          std::getenv("PET_NODE_RANK") == nullptr) {
        if (const char* index = std::getenv("JOB_COMPLETION_INDEX"); index != nullptr && *index != '\0') {
          char* end = nullptr;
          const long value = std::strtol(index, &end, 10);
          if (*end != '\0' || value < 0 || value > (1 << 20)) {
            throw chorus::UsageError(std::string("chorus run: JOB_COMPLETION_INDEX='") + index +
                                     "' is not a node rank; pass --node-rank");
          }
          launch.node_rank = static_cast<int>(value);
        }
      }
      // A Kubeflow PyTorchJob pod (training operator v1) names its master as MASTER_ADDR and
      // MASTER_PORT (newer operators also as PET_MASTER_ADDR/PORT, read above): with several nodes
      // and no endpoint given, they are node 0's. Only in such a pod (PET_NNODES set), so that a
      // stray MASTER_ADDR in a shell does not join a job by surprise.
      if (launch.nnodes > 1 && launch.rdzv_endpoint.empty() && launch.master_addr.empty() &&
          launch.master_port < 0 && std::getenv("PET_NNODES") != nullptr) {
        const char* addr = std::getenv("MASTER_ADDR");
        const char* port = std::getenv("MASTER_PORT");
        if (addr != nullptr && *addr != '\0' && port != nullptr && *port != '\0') {
          const std::string host(addr);
          launch.rdzv_endpoint = (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + port;
          std::fprintf(stderr, "chorus run: node 0's store at MASTER_ADDR:MASTER_PORT (%s), as a PyTorchJob sets them\n",
                       launch.rdzv_endpoint.c_str());
        }
      }
      if (standalone && (launch.nnodes != 1 || launch.max_nodes > 0 || !launch.rdzv_endpoint.empty() || !launch.master_addr.empty())) {
        throw chorus::UsageError("chorus run: --standalone is one node with a local store; drop it, or drop "
                                 "--nnodes/--rdzv-endpoint/--master-addr");
      }
      return chorus::launch::run(launch);
    }
    if (b->parsed()) return chorus::tools::run_bench(bench);
    if (render_cmd->parsed()) return chorus::tools::run_render_fashion_mnist(render);
    if (pairs_cmd->parsed()) return chorus::tools::run_render_fashion_mnist_pairs(pairs);
    if (upload_cmd->parsed()) return chorus::tools::run_upload(upload);
    if (rep->parsed()) return run_report(report, gnuplot_timeout_s);
  } catch (const chorus::UsageError& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return kUsageExit;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "chorus: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
