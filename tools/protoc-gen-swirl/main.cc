// protoc-gen-swirl: protoc plugin for swirl services (see generator.h).
//
//   protoc --plugin=protoc-gen-swirl=path/to/protoc-gen-swirl --swirl_out=OUT_DIR foo.proto

#include "google/protobuf/compiler/plugin.h"
#include "tools/protoc-gen-swirl/generator.h"

int main(int argc, char* argv[]) {
  swirl::protoc_gen::SwirlGenerator generator;
  return google::protobuf::compiler::PluginMain(argc, argv, &generator);
}
