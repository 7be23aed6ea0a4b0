# The bucket's own customer-managed key: rotated yearly, with an explicit key policy.

data "aws_iam_policy_document" "key" {
  # These three checks read a key policy as if it were an identity policy. In a key policy,
  # Resource "*" is the key itself, and the account-root statement is what lets IAM policies
  # (this module's training and read-only policies) grant the key's use at all.
  #checkov:skip=CKV_AWS_109:key policy: Resource "*" means this key; the account root must administer it
  #checkov:skip=CKV_AWS_111:key policy: Resource "*" means this key; the account root must administer it
  #checkov:skip=CKV_AWS_356:key policy: Resource "*" means this key; the account root must administer it
  # The account administers the key and delegates its use through IAM policies (the training
  # and read-only policies of this module). Without this statement nobody could ever change
  # the key policy again. In a key policy, Resource "*" means "this key".
  statement {
    sid       = "AccountAdministersThroughIAM"
    actions   = ["kms:*"]
    resources = ["*"]

    principals {
      type        = "AWS"
      identifiers = [local.account_root]
    }
  }

  dynamic "statement" {
    for_each = length(var.kms_key_administrator_arns) > 0 ? [1] : []

    content {
      sid = "KeyAdministrators"
      actions = [
        "kms:CancelKeyDeletion",
        "kms:DescribeKey",
        "kms:DisableKeyRotation",
        "kms:EnableKeyRotation",
        "kms:GetKeyPolicy",
        "kms:GetKeyRotationStatus",
        "kms:ListResourceTags",
        "kms:PutKeyPolicy",
        "kms:ScheduleKeyDeletion",
        "kms:TagResource",
        "kms:UntagResource",
        "kms:UpdateKeyDescription",
      ]
      resources = ["*"]

      principals {
        type        = "AWS"
        identifiers = var.kms_key_administrator_arns
      }
    }
  }
}

resource "aws_kms_key" "this" {
  description             = "ckptstore checkpoints in s3://${var.bucket_name}"
  enable_key_rotation     = true
  deletion_window_in_days = var.kms_deletion_window_days
  policy                  = data.aws_iam_policy_document.key.json
  tags                    = var.tags
}

resource "aws_kms_alias" "this" {
  name          = "alias/${local.iam_name}"
  target_key_id = aws_kms_key.this.key_id
}
