// The examples over TLS, each server and client a process of its own: a CA made here (openssl)
// signs a server certificate for 127.0.0.1 (an IP SAN) and a client certificate; echo_server
// with echo_client, and blockstore_server with blockstore_cli, work over it, and a client that
// trusts another CA (or speaks plaintext, or has no client certificate where one is required)
// is refused.

#include <gtest/gtest.h>

#include <signal.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "rpc/testing/process.h"

namespace swirl {
namespace {

constexpr char kOpenssl[] = "/usr/bin/openssl";
constexpr char kEchoServer[] = "examples/echo/echo_server";
constexpr char kEchoClient[] = "examples/echo/echo_client";
constexpr char kBlockServer[] = "examples/blockstore/blockstore_server";
constexpr char kBlockCli[] = "examples/blockstore/blockstore_cli";
constexpr absl::Duration kTimeout = absl::Seconds(30);

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/", name);
}

void WriteFile(const std::string& path, const std::string& data) {
  std::ofstream(path, std::ios::binary) << data;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Runs `argv` to its end: its exit code, or -1 (and a test failure) if it could not start or
// did not finish within kTimeout.
int RunToEnd(const std::vector<std::string>& argv) {
  auto child = testing::ChildProcess::Spawn(argv);
  if (!child.ok()) {
    ADD_FAILURE() << argv[0] << ": " << child.status();
    return -1;
  }
  auto rc = child->Wait(kTimeout);
  if (!rc.ok()) {
    ADD_FAILURE() << argv[0] << " did not finish: " << rc.status();
    child->Kill();
    return -1;
  }
  return *rc;
}

// The certificates, made once for the suite.
struct Pki {
  std::string ca, server_cert, server_key;  // the CA, and the server's certificate for 127.0.0.1
  std::string other_ca;                     // a CA that signed nothing of ours
  std::string alice_cert, alice_key;        // a client certificate: SAN DNS:alice.tenants.test
  std::string carol_cert, carol_key;        // SAN DNS:carol.tenants.test, signed by our CA
  std::string mallory_cert, mallory_key;    // alice's name, signed by the other CA
};

// A key and certificate signed by `ca` (or self-signed when `ca` is empty) with subject `cn` and
// the extensions in `ext` (an openssl extfile line); false if openssl failed.
bool MakeCertificate(const std::string& name, const std::string& cn, const std::string& ext,
                     const std::string& ca, const std::string& ca_key) {
  const std::string key = TempPath(name + ".key");
  const std::string cert = TempPath(name + ".pem");
  const std::vector<std::string> new_key = {"-newkey", "ec", "-pkeyopt",
                                            "ec_paramgen_curve:prime256v1", "-nodes",
                                            "-keyout", key, "-subj", "/CN=" + cn};
  if (ca.empty()) {
    std::vector<std::string> argv = {kOpenssl, "req", "-x509", "-days", "2", "-out", cert};
    argv.insert(argv.end(), new_key.begin(), new_key.end());
    return RunToEnd(argv) == 0;
  }
  const std::string csr = TempPath(name + ".csr");
  std::vector<std::string> request = {kOpenssl, "req", "-out", csr};
  request.insert(request.end(), new_key.begin(), new_key.end());
  if (RunToEnd(request) != 0) return false;
  const std::string extfile = TempPath(name + ".ext");
  WriteFile(extfile, ext + "\n");
  return RunToEnd({kOpenssl, "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key,
              "-CAcreateserial", "-days", "2", "-out", cert, "-extfile", extfile}) == 0;
}

class TlsExamplesTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    pki_ = new Pki{.ca = TempPath("ca.pem"),
                   .server_cert = TempPath("server.pem"),
                   .server_key = TempPath("server.key"),
                   .other_ca = TempPath("other_ca.pem"),
                   .alice_cert = TempPath("alice.pem"),
                   .alice_key = TempPath("alice.key"),
                   .carol_cert = TempPath("carol.pem"),
                   .carol_key = TempPath("carol.key"),
                   .mallory_cert = TempPath("mallory.pem"),
                   .mallory_key = TempPath("mallory.key")};
    made_ = MakeCertificate("ca", "swirl test CA", "", "", "") &&
            MakeCertificate("other_ca", "another CA", "", "", "") &&
            MakeCertificate("server", "swirl test server", "subjectAltName=IP:127.0.0.1",
                            pki_->ca, TempPath("ca.key")) &&
            MakeCertificate("alice", "alice", "subjectAltName=DNS:alice.tenants.test", pki_->ca,
                            TempPath("ca.key")) &&
            MakeCertificate("carol", "carol", "subjectAltName=DNS:carol.tenants.test", pki_->ca,
                            TempPath("ca.key")) &&
            MakeCertificate("mallory", "alice", "subjectAltName=DNS:alice.tenants.test",
                            pki_->other_ca, TempPath("other_ca.key"));
  }
  static void TearDownTestSuite() {
    delete pki_;
    pki_ = nullptr;
  }
  void SetUp() override { ASSERT_TRUE(made_) << "openssl could not make the certificates"; }

  std::vector<std::string> ServerTls() const {
    return {"--tls_cert=" + pki_->server_cert, "--tls_key=" + pki_->server_key};
  }

  static Pki* pki_;
  static bool made_;
};
Pki* TlsExamplesTest::pki_ = nullptr;
bool TlsExamplesTest::made_ = false;

TEST_F(TlsExamplesTest, EchoOverTlsAndAClientTrustingAnotherCaIsRefused) {
  std::vector<std::string> args = {"--address=127.0.0.1:0", "--token=echo-token", "--cores=-1"};
  for (const std::string& a : ServerTls()) args.push_back(a);
  auto server = testing::SpawnServer(kEchoServer, args);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = absl::StrCat("--server=127.0.0.1:", server->second);
  const std::vector<std::string> client = {kEchoClient, address, "--token=echo-token",
                                           "--iterations=20", "--core=-1"};
  auto with = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> argv = client;
    argv.insert(argv.end(), extra.begin(), extra.end());
    return argv;
  };
  EXPECT_EQ(RunToEnd(with({"--tls_ca=" + pki_->ca})), 0);
  // The attacker's view: a server it cannot tell from ours unless it checks the CA. A client that
  // trusts another CA does not take this server's certificate, so nothing (the token included)
  // goes to it; neither does a plaintext client get through to a TLS server.
  EXPECT_NE(RunToEnd(with({"--tls_ca=" + pki_->other_ca})), 0);
  EXPECT_NE(RunToEnd(with({})), 0);
  // A certificate for 127.0.0.1 is not one for another name.
  EXPECT_NE(RunToEnd(with({"--tls_ca=" + pki_->ca, "--tls_target_name=swirl.example"})), 0);
  server->first.Signal(SIGTERM);
  auto rc = server->first.Wait(kTimeout);
  ASSERT_TRUE(rc.ok()) << rc.status();
  EXPECT_EQ(*rc, 0);
}

TEST_F(TlsExamplesTest, BlockstoreOverTlsAndAClientTrustingAnotherCaIsRefused) {
  std::vector<std::string> args = {"--address=127.0.0.1:0", "--token=block-token", "--cores=-1",
                                   "--volume=v:1m"};
  for (const std::string& a : ServerTls()) args.push_back(a);
  auto server = testing::SpawnServer(kBlockServer, args);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = absl::StrCat("--server=127.0.0.1:", server->second);
  const std::string input = TempPath("block_in");
  const std::string output = TempPath("block_out");
  std::string data(8192, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7 + 3);
  WriteFile(input, data);
  const std::string ca = "--tls_ca=" + pki_->ca;
  EXPECT_EQ(RunToEnd({kBlockCli, address, "--token=block-token", ca, "write", "--volume=v",
                 "--offset=4k", "--input=" + input}),
            0);
  EXPECT_EQ(RunToEnd({kBlockCli, address, "--token=block-token", ca, "read", "--volume=v",
                 "--offset=4k", "--length=8k", "--output=" + output}),
            0);
  EXPECT_TRUE(ReadFile(output) == data) << "data read back over TLS differs";
  // 3: cannot connect.
  EXPECT_EQ(RunToEnd({kBlockCli, address, "--token=block-token", "--tls_ca=" + pki_->other_ca, "stat"}),
            3);
  EXPECT_EQ(RunToEnd({kBlockCli, address, "--token=block-token", "stat"}), 3);
  server->first.Signal(SIGTERM);
  auto rc = server->first.Wait(kTimeout);
  ASSERT_TRUE(rc.ok()) << rc.status();
  EXPECT_EQ(*rc, 0);
}

// Mutual TLS: alice and carol are named by their client certificates (no tokens); alice owns
// volume "a". carol, with a good certificate of her own, is refused alice's volume; a client
// without a certificate, with one in alice's name from another CA, or with a certificate and
// a token that name two principals, is refused altogether.
TEST_F(TlsExamplesTest, AClientCertificateNamesItsPrincipal) {
  const std::string principals = TempPath("tls_principals");
  WriteFile(principals,
            "alice identity=alice.tenants.test\ncarol identity=carol.tenants.test\n"
            "bob token=bob-token\n");
  std::vector<std::string> args = {"--address=127.0.0.1:0", "--principals_file=" + principals,
                                   "--cores=-1", "--volume=a:1m", "--owner=a=alice",
                                   "--tls_client_ca=" + pki_->ca};
  for (const std::string& a : ServerTls()) args.push_back(a);
  auto server = testing::SpawnServer(kBlockServer, args);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = absl::StrCat("--server=127.0.0.1:", server->second);
  const std::string ca = "--tls_ca=" + pki_->ca;
  const std::string output = TempPath("mtls_out");
  const std::vector<std::string> read = {"read", "--volume=a", "--length=4k",
                                         "--output=" + output};
  auto cli = [&](std::vector<std::string> argv) {
    argv.insert(argv.begin(), {kBlockCli, address, ca});
    argv.insert(argv.end(), read.begin(), read.end());
    return RunToEnd(argv);
  };
  EXPECT_EQ(cli({"--tls_cert=" + pki_->alice_cert, "--tls_key=" + pki_->alice_key}), 0);
  // 7: PERMISSION_DENIED, the volume is another principal's.
  EXPECT_EQ(cli({"--tls_cert=" + pki_->carol_cert, "--tls_key=" + pki_->carol_key}), 7);
  // 3, cannot connect: bob has a token but no certificate, so TLS refuses him before his token
  // is looked at; mallory, with alice's name on a certificate from another CA, likewise.
  EXPECT_EQ(cli({"--token=bob-token"}), 3);
  EXPECT_EQ(cli({"--tls_cert=" + pki_->mallory_cert, "--tls_key=" + pki_->mallory_key}), 3);
  // Credentials that name two principals (carol's certificate, bob's token) are refused, not
  // taken as whichever comes first: 3 as well, not 7.
  EXPECT_EQ(cli({"--tls_cert=" + pki_->carol_cert, "--tls_key=" + pki_->carol_key,
                 "--token=bob-token"}),
            3);
  server->first.Signal(SIGTERM);
  auto rc = server->first.Wait(kTimeout);
  ASSERT_TRUE(rc.ok()) << rc.status();
  EXPECT_EQ(*rc, 0);
}

}  // namespace
}  // namespace swirl
