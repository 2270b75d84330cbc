from generation.task.v1 import task_pb2


def test_queue_claim_complete_roundtrip(stub, tool_id):
    queued = stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id)).task
    claimed = stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool_id))
    assert claimed.task.id == queued.id
    done = stub.CompleteTask(
        task_pb2.CompleteTaskRequest(task_id=queued.id, lease_token=claimed.lease_token)
    ).task
    assert done.status == task_pb2.TASK_STATUS_COMPLETED
