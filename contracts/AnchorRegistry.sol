// SPDX-License-Identifier: MIT
pragma solidity 0.8.37;

/// @title AnchorRegistry: a write-once record of build receipts.
/// @notice Anyone may anchor a digest (a mindxtrain manifest's BLAKE3 digest) once; the first
/// anchor stands forever. There is no owner, no admin, no setter, no upgrade path: what is
/// recorded can be read by anyone and changed by no one.
contract AnchorRegistry {
    /// @notice What the chain knows of an anchored digest. `timestamp` is 0 for a digest never
    /// anchored. `blockNumber` lets anyone find the anchoring transaction from the record alone.
    struct Record {
        address submitter;
        uint64 timestamp;
        uint64 blockNumber;
        string uri;
    }

    mapping(bytes32 => Record) private records;

    /// @notice The digest is anchored already: the registry is write-once.
    error AlreadyAnchored(bytes32 digest, address submitter, uint64 timestamp);

    event Anchored(bytes32 indexed digest, address indexed submitter, string uri);

    /// @notice Record `digest` with the sender, this block's time and `uri` (where the artifacts
    /// can be found; may be empty). Reverts with AlreadyAnchored if the digest has a record.
    function anchor(bytes32 digest, string calldata uri) external {
        Record storage r = records[digest];
        if (r.timestamp != 0) {
            revert AlreadyAnchored(digest, r.submitter, r.timestamp);
        }
        records[digest] = Record(msg.sender, uint64(block.timestamp), uint64(block.number), uri);
        emit Anchored(digest, msg.sender, uri);
    }

    /// @notice The record of `digest` (all zero, timestamp 0, if it was never anchored).
    function record(bytes32 digest) external view returns (Record memory) {
        return records[digest];
    }
}
