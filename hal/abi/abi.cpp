#include "hal/abi/desc.h"

namespace hcomm::hal::abi {

const char* cq_status_name(CqStatus s) {
  switch (s) {
    case CqStatus::OK: return "OK";
    case CqStatus::BAD_OPCODE: return "BAD_OPCODE";
    case CqStatus::BAD_LENGTH: return "BAD_LENGTH";
    case CqStatus::BAD_ALIGN: return "BAD_ALIGN";
    case CqStatus::BAD_DTYPE: return "BAD_DTYPE";
    case CqStatus::BAD_REDOP: return "BAD_REDOP";
    case CqStatus::BAD_FIELD: return "BAD_FIELD";
    case CqStatus::SRC_FAULT: return "SRC_FAULT";
    case CqStatus::DST_FAULT: return "DST_FAULT";
    case CqStatus::SRC_PERM: return "SRC_PERM";
    case CqStatus::DST_PERM: return "DST_PERM";
    case CqStatus::HOST_FAULT: return "HOST_FAULT";
    case CqStatus::PEER_FAULT: return "PEER_FAULT";
    case CqStatus::INJECTED: return "INJECTED";
    case CqStatus::ABORTED: return "ABORTED";
  }
  return "UNKNOWN";
}

}  // namespace hcomm::hal::abi
